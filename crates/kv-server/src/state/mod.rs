//! Durable state: the index as a materialized view of an ordered log of accepted changes.
//!
//! - [`log`]: the local append-only log (segment files of checked records) behind
//!   [`log::EventLog`].

pub mod log;
