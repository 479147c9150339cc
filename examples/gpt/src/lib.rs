//! A small decoder-only GPT trained on a byte-level text corpus with burn-flash's attention
//! module; the binary (`main.rs`) is its command line. See `docs/gpt.md` at the repository root.
#![warn(missing_docs)]

pub mod data;
pub mod model;
pub mod train;
