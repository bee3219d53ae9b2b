//! The settings-validation error, at the bottom of the crate so that every layer that owns
//! settings (destinations, dispatch) can refuse a value without importing the layer that
//! composes them ([`crate::config`]).

/// A setting that could not be accepted; the message names it.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting {setting}: {problem}")]
pub struct ConfigError {
    pub setting: String,
    pub problem: String,
}

impl ConfigError {
    /// `setting` (as the user wrote it: a flag's name or `destinations.NAME.FIELD`) refused
    /// for `problem`.
    pub fn new(setting: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            setting: setting.into(),
            problem: problem.into(),
        }
    }
}
