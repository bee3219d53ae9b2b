//! The tests that need no server: the code and the docs against each other, and the lease
//! protocol model-checked. `make check` runs them with the Postgres suites.
//!
//! - [`layers`]: the library's modules point down only;
//! - [`config_reference`]: the configuration reference against the code's definitions;
//! - [`lease_model`]: every interleaving of a few relayers over a few messages, checked.

mod config_reference;
mod layers;
mod lease_model;
