//! The index's tests, one binary: one named test per rule of the contract (`rules`), and the
//! model-based property test against a naive reference (`model`), sharing the request
//! builders (`requests`).

mod model;
mod requests;
mod rules;
