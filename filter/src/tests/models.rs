//! Unit tests of `crate::models`.
use super::*;
