//! Who floods and who must be isolated from it, read from the scenario (levee's
//! configuration never knows).

use levee_sim::report::Report;
use levee_sim::scenario::{Phase, Rate, Scenario, Tenant};

/// A tenant with its own schedule that at some point sends at least the fleet's whole
/// capacity by itself: the noisy neighbour the others must be isolated from. (The drill
/// knows the scenario; levee's configuration does not.)
pub(crate) fn is_flooder(scenario: &Scenario, tenant: &Tenant) -> bool {
    let Some(phases) = &tenant.phases else {
        return false;
    };
    let total: f64 = phases.iter().map(Phase::duration_s).sum();
    let steps = (total * 10.0).ceil() as u32;
    (0..steps).any(|i| {
        let t = f64::from(i) / 10.0;
        let mut start = 0.0;
        for p in phases {
            if t < start + p.duration_s() {
                return p.rate_at(t - start, &|r| scenario.resolve(r)) >= scenario.capacity_rps;
            }
            start += p.duration_s();
        }
        false
    })
}

/// The same scenario with every flooder calm: sending all along at the rate it starts at.
pub(crate) fn calm_flooders(base: &Scenario) -> Scenario {
    let mut s = base.clone();
    s.name = format!("{} (flooder calm)", base.name);
    let total = base.duration_s();
    for t in s.tenants.iter_mut() {
        if is_flooder(base, t) {
            let first = t
                .phases
                .as_ref()
                .and_then(|p| p.first())
                .map_or(0.0, |p| p.rate_at(0.0, &|r| base.resolve(r)));
            t.phases = Some(vec![Phase::Steady {
                duration_s: total,
                rps: Rate::Rps(first),
            }]);
        }
    }
    s
}

/// Each flooder with the tenants of its tier (itself included), in the scenario's order:
/// whom its goodput is compared with ([`crate::verdicts::flooder_share`]).
pub(crate) fn flooders_with_tier(scenario: &Scenario) -> Vec<(String, Vec<String>)> {
    scenario
        .tenants
        .iter()
        .filter(|t| is_flooder(scenario, t))
        .map(|f| {
            let tier = scenario
                .tenants
                .iter()
                .filter(|t| t.tier == f.tier)
                .map(|t| t.name.clone())
                .collect();
            (f.name.clone(), tier)
        })
        .collect()
}

/// Premium requests that a client-side rate check with each premium tenant's configured
/// quota finds over it, given `sends` (per tenant name: when each request was first sent, in
/// ms, in order — from the client's own record of a run, every session turn included): the
pub(crate) struct QuietGroup {
    pub name: String,
    pub group: Option<String>,
    pub tenant: Option<String>,
}

impl QuietGroup {
    pub(crate) fn of<'r>(&self, r: &'r Report) -> Option<&'r levee_sim::report::Group> {
        match (&self.group, &self.tenant) {
            (Some(g), _) => r.per_group.get(g),
            (None, Some(t)) => r.per_tenant.get(t),
            (None, None) => None,
        }
    }
}

pub(crate) fn quiet_groups(scenario: &Scenario) -> Vec<QuietGroup> {
    let flooders: Vec<&Tenant> = scenario
        .tenants
        .iter()
        .filter(|t| is_flooder(scenario, t))
        .collect();
    if flooders.is_empty() {
        return Vec::new();
    }
    let flooder_groups: Vec<&str> = flooders.iter().filter_map(|t| t.group.as_deref()).collect();
    let mut groups: Vec<&str> = scenario
        .tenants
        .iter()
        .filter_map(|t| t.group.as_deref())
        .filter(|g| !flooder_groups.contains(g))
        .collect();
    groups.sort();
    groups.dedup();
    if !groups.is_empty() {
        return groups
            .into_iter()
            .map(|g| QuietGroup {
                name: format!("group {g}"),
                group: Some(g.to_string()),
                tenant: None,
            })
            .collect();
    }
    scenario
        .tenants
        .iter()
        .filter(|t| !is_flooder(scenario, t))
        .map(|t| QuietGroup {
            name: format!("tenant {}", t.name),
            group: None,
            tenant: Some(t.name.clone()),
        })
        .collect()
}
