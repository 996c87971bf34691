//! levee-policy: every overload decision levee makes, as pure code.
//!
//! Nothing here does I/O or spawns tasks; time is injected through [`Clock`] so that every
//! decision can be replayed with a manual clock in tests.
