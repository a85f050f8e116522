//! The client library's tests: the client against real servers (`client`). The hashing it
//! re-exports is tested in `kv-prompt`.

mod client;
