//! The engine's error type: every failure a user can act on, with a message naming the problem.

use std::path::PathBuf;

#[derive(thiserror::Error, Debug)]
pub enum Error {
    #[error("{0}")]
    Config(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("model directory: {0}")]
    Format(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Input(String),
}

impl Error {
    /// The same error again, for each of several callers one failure stopped (a batched pass).
    pub fn shared(&self) -> Error {
        match self {
            Error::Config(m) => Error::Config(m.clone()),
            Error::Checkpoint(m) => Error::Checkpoint(m.clone()),
            Error::Format(m) => Error::Format(m.clone()),
            Error::Input(m) => Error::Input(m.clone()),
            Error::Io { path, source } => Error::Io {
                path: path.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Attaches a path to an I/O error.
pub fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}
