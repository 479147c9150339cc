//! The integration suite of burn-flash lives in `tests/suite/`; this package holds no code.
