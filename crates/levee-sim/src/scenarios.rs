//! Scenarios shipped in the binary (from the repository's `scenarios/` directory), so that
//! `levee sim` and `levee drill` can run them by name with no file at hand.

use crate::scenario::Scenario;
use anyhow::Context;

/// `(name, TOML text)` of every shipped scenario.
pub const BUILTIN: &[(&str, &str)] = &[
    ("steady", include_str!("../../../scenarios/steady.toml")),
    (
        "flash-crowd",
        include_str!("../../../scenarios/flash-crowd.toml"),
    ),
    (
        "slow-poison",
        include_str!("../../../scenarios/slow-poison.toml"),
    ),
    (
        "retry-storm",
        include_str!("../../../scenarios/retry-storm.toml"),
    ),
    (
        "noisy-neighbor",
        include_str!("../../../scenarios/noisy-neighbor.toml"),
    ),
    (
        "backend-failure",
        include_str!("../../../scenarios/backend-failure.toml"),
    ),
    (
        "heavy-tail",
        include_str!("../../../scenarios/heavy-tail.toml"),
    ),
    (
        "crash-mid-flood",
        include_str!("../../../scenarios/crash-mid-flood.toml"),
    ),
    (
        "overload-3x",
        include_str!("../../../scenarios/overload-3x.toml"),
    ),
    (
        "habitual-max-tokens",
        include_str!("../../../scenarios/habitual-max-tokens.toml"),
    ),
    (
        "long-answers",
        include_str!("../../../scenarios/long-answers.toml"),
    ),
    (
        "async-batch",
        include_str!("../../../scenarios/async-batch.toml"),
    ),
    (
        "async-batch-baseline",
        include_str!("../../../scenarios/async-batch-baseline.toml"),
    ),
];

/// Names of the shipped scenarios.
pub fn names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

/// The TOML text of a shipped scenario.
pub fn builtin_toml(name: &str) -> Option<&'static str> {
    BUILTIN.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// A shipped scenario, parsed. Errors list the names that exist.
pub fn builtin(name: &str) -> anyhow::Result<Scenario> {
    let text = builtin_toml(name).with_context(|| {
        format!(
            "no shipped scenario named {name:?}; choose one of: {}",
            names().join(", ")
        )
    })?;
    Scenario::from_toml_str(text).with_context(|| format!("shipped scenario {name:?}"))
}
