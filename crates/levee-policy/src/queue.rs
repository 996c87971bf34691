//! The fair priority queue.
//!
//! * Strict priority across tiers: tier 0 is served first, always.
//! * Inside a tier, weighted fairness across tenants by token cost, with the Virtual Token
//!   Counter (VTC) of Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024):
//!   each tenant has a counter; the backlogged tenant with the smallest counter is served
//!   next and its counter grows by `cost / weight`; a tenant that becomes backlogged is
//!   lifted to the tier's floor (the smallest active counter seen), so idling banks no credit.
//! * FIFO inside a tenant.
//! * Bounded by entry count and by queued tokens; a full queue refuses a push with a reason.
//! * Entries carry deadlines and [`FairQueue::expire`] hands back the expired ones;
//!   [`FairQueue::cancel`] removes an entry at once.
//!
//! Costs: push, pop and cancel are O(log n): one `BTreeSet` step for the tenant order and
//! one binary-heap step for deadlines, one hash lookup per push (tenant interning) and none
//! per pop. A cancelled ticket is skipped lazily at its tenant's FIFO head (a FIFO is
//! compacted when more than half of it is dead) and in the deadline heap (compacted when
//! stale entries outnumber live ones).
//!
//! Fairness bound (ours, stated precisely; it is the paper's Theorem for weighted VTC with
//! the cost charged in full at dispatch): let `U = max over dispatched requests of
//! cost/weight`. Every backlogged tenant's counter lies in `[floor, floor + U]`, so for any
//! two tenants `f`, `g` of one tier that are both backlogged at two pops `p1 < p2`, the
//! weighted service they received between them satisfies
//! `|S_f/w_f − S_g/w_g| ≤ 2·U` (plus at most 2 units of [`VIRTUAL_SCALE`] rounding).
//! With equal weights this is the "2 × the largest request cost".
//!
//! Priority aging inside a tier ([`FairQueue::set_aging`], off by default): a weight is a
//! share, not a promise of time, so a weight-1 tenant behind a steady weight-100 load waits
//! about a hundred turns for each of its own. With an aging horizon `H`, an entry that has
//! waited `H` outranks every entry of its tier that has not, and among such entries the
//! oldest goes first. Its effective priority so rises with its wait, in one step at `H`.
//!
//! Aging bound (stated precisely): once an entry `e` of tier `t` has waited `H`, every later
//! pop of tier `t` takes an entry pushed no later than `e` — unless the caller's judge passed
//! over the tenants of the older entries ([`Pick::SkipTenant`]: held back by their own share)
//! or more than [`AGING_WALK`] such passed-over entries stand before it. So `e` leaves after
//! at most `n` pops of its tier, `n` being the entries of `t` pushed before it and still
//! queued when it reached `H` (plus one: itself); strict priority across tiers still holds.
//! Its wait is at most `H` plus the service time of those `n` entries. The fairness bound
//! above holds for the pops that aging does not take; an aged pop is charged to its tenant's
//! counter like any other, so aging moves service in time but gives no tenant extra.

use crate::clock::Timestamp;
use crate::fasthash::FastState;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::hash::Hash;

/// A priority tier. Tier 0 is the highest priority; larger numbers wait for smaller ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Tier(pub u8);

/// Identifies a queued entry, for [`FairQueue::cancel`]. Unique for the queue's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(u64);

impl Ticket {
    /// The raw id (for logs).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// Virtual-counter units per token at weight 1 (counters are `cost · SCALE / weight`).
pub const VIRTUAL_SCALE: u128 = 1 << 20;

/// With shortest-reservation-first on ([`FairQueue::set_shortest_first`]), how many of a
/// tenant's oldest entries a pop chooses the cheapest from (so a pop stays O(1) per tenant).
pub const SHORTEST_WINDOW: usize = 32;

/// With a preference ([`FairQueue::pop_ready_preferring`]), how many of a tenant's oldest
/// entries its turn ranks.
pub const PREFER_WINDOW: usize = 16;

/// How many times a tenant's oldest entry may be passed over for a better-ranked entry of
/// its own ([`FairQueue::pop_ready_preferring`]) before its turn takes it regardless.
pub const PREFER_PASSES: u8 = 8;

/// Most aged entries of passed-over tenants one pop looks past before it falls back to the
/// fair order (so a pop stays cheap when many aged tenants are held back by their shares).
pub const AGING_WALK: usize = 64;

/// Queue bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimits {
    /// Number of tiers (tiers `0..tiers`); at least 1.
    pub tiers: u8,
    /// Most entries queued at once.
    pub max_len: usize,
    /// Most tokens (sum of entry costs) queued at once.
    pub max_tokens: u64,
}

/// Why a push was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PushRefusal {
    /// `max_len` entries are queued.
    QueueFull,
    /// The entry's cost would take queued tokens past `max_tokens`.
    TokensFull,
    /// The tier is not configured.
    NoSuchTier,
}

impl PushRefusal {
    /// A short stable name for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PushRefusal::QueueFull => "queue_full",
            PushRefusal::TokensFull => "queue_tokens_full",
            PushRefusal::NoSuchTier => "no_such_tier",
        }
    }
}

/// A refused push, returning the item.
#[derive(Debug)]
pub struct Rejected<T> {
    /// Why.
    pub reason: PushRefusal,
    /// The item, back to the caller.
    pub item: T,
}

/// An entry leaving the queue (popped, cancelled or expired).
#[derive(Debug)]
pub struct Entry<T, K> {
    /// Its ticket.
    pub ticket: Ticket,
    /// Its tier.
    pub tier: Tier,
    /// Its tenant.
    pub tenant: K,
    /// Its token cost.
    pub cost: u64,
    /// When it was pushed.
    pub enqueued_at: Timestamp,
    /// When it expires.
    pub deadline: Timestamp,
    /// The caller's payload.
    pub item: T,
}

/// Depth of one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    /// Entries queued.
    pub len: usize,
    /// Tokens queued.
    pub tokens: u64,
    /// Tenants with at least one entry.
    pub backlogged_tenants: usize,
}

/// Queue figures for metrics.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QueueStats {
    /// Entries queued.
    pub len: usize,
    /// Tokens queued.
    pub tokens: u64,
    /// Per tier, index = tier number.
    pub tiers: Vec<TierStats>,
}

/// One tenant's backlog in one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantBacklog {
    /// The tier.
    pub tier: Tier,
    /// Entries queued.
    pub len: usize,
    /// Tokens queued.
    pub tokens: u64,
}

#[derive(Debug)]
struct Slot<T, K> {
    tier: u8,
    tenant: u32,
    key: K,
    cost: u64,
    enqueued_at: Timestamp,
    deadline: Timestamp,
    /// Times it was passed over, as its tenant's oldest, for a better-ranked entry.
    passed: u8,
    item: T,
}

#[derive(Debug)]
struct SlabSlot<T, K> {
    generation: u32,
    data: Option<Slot<T, K>>,
}

#[derive(Debug, Default)]
struct TenantQ {
    counter: u128,
    fifo: VecDeque<u64>,
    live: usize,
    tokens: u64,
}

#[derive(Debug)]
struct TenantRec<K> {
    key: Option<K>,
    weight: u32,
    live_total: usize,
    per_tier: Vec<TenantQ>,
}

#[derive(Debug, Default)]
struct TierQ {
    active: BTreeSet<(u128, u32)>,
    floor: u128,
    len: usize,
    tokens: u64,
    /// Tickets in push order (for aging; dead ones dropped lazily, compacted when they
    /// outnumber the live ones). Kept only while aging is on.
    order: VecDeque<u64>,
}

/// What [`FairQueue::pop_where`] does with a candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Pop it.
    Take,
    /// Pass over this tenant for now; look at the next one.
    SkipTenant,
    /// Pop nothing now.
    Stop,
}

/// The fair priority queue. `K` is the tenant key.
///
/// Internally entries live in a slab (a ticket is slot index + generation), tenants are
/// interned to small ids (one hash lookup per push, none per pop), and deadlines sit in a
/// min-heap whose stale entries are dropped lazily (and compacted when they outnumber the
/// live ones).
#[derive(Debug)]
pub struct FairQueue<T, K> {
    limits: QueueLimits,
    slab: Vec<SlabSlot<T, K>>,
    free_slots: Vec<u32>,
    deadlines: BinaryHeap<Reverse<(Timestamp, u64)>>,
    tiers: Vec<TierQ>,
    ids: HashMap<K, u32, FastState>,
    tenants: Vec<TenantRec<K>>,
    free_ids: Vec<u32>,
    weights: HashMap<K, u32, FastState>,
    len: usize,
    tokens: u64,
    aging: Option<std::time::Duration>,
    shortest_first: bool,
}

/// A rank for [`FairQueue::pop_ready_preferring`] (the type of "no rank").
type Rank<T, K> = fn(Tier, &K, u64, &T) -> u8;

#[inline]
fn vcost(cost: u64, weight: u32) -> u128 {
    cost as u128 * VIRTUAL_SCALE / weight.max(1) as u128
}

#[inline]
fn split(ticket: u64) -> (usize, u32) {
    ((ticket & 0xffff_ffff) as usize, (ticket >> 32) as u32)
}

impl<T, K: Hash + Eq + Ord + Clone> FairQueue<T, K> {
    /// An empty queue.
    pub fn new(limits: QueueLimits) -> Self {
        let tiers = limits.tiers.max(1);
        FairQueue {
            limits: QueueLimits { tiers, ..limits },
            slab: Vec::new(),
            free_slots: Vec::new(),
            deadlines: BinaryHeap::new(),
            tiers: (0..tiers).map(|_| TierQ::default()).collect(),
            ids: HashMap::default(),
            tenants: Vec::new(),
            free_ids: Vec::new(),
            weights: HashMap::default(),
            len: 0,
            tokens: 0,
            aging: None,
            shortest_first: false,
        }
    }

    /// Shortest reservation first inside each tenant's backlog (off: FIFO). A tenant's turn
    /// (the fair order across tenants is unchanged) takes its cheapest entry among its
    /// [`SHORTEST_WINDOW`] oldest, so its short requests do not wait behind its own long
    /// ones. Aged entries still go oldest first, so aging bounds every entry's wait;
    /// `position_of` assumes FIFO and is an estimate while this is on.
    pub fn set_shortest_first(&mut self, on: bool) {
        self.shortest_first = on;
    }

    /// Turns priority aging on with horizon `horizon` (see the module's aging bound), or off
    /// with `None`. Entries queued before aging was turned on do not age.
    pub fn set_aging(&mut self, horizon: Option<std::time::Duration>) {
        if horizon.is_none() {
            self.tiers
                .iter_mut()
                .for_each(|t| t.order = VecDeque::new());
        }
        self.aging = horizon;
    }

    /// The aging horizon, if aging is on.
    pub fn aging(&self) -> Option<std::time::Duration> {
        self.aging
    }

    /// The bounds.
    pub fn limits(&self) -> QueueLimits {
        self.limits
    }

    /// Sets a tenant's fairness weight (default 1; 0 is treated as 1). A tenant of weight 2
    /// gets twice the token throughput of a weight-1 tenant when both are backlogged.
    pub fn set_weight(&mut self, tenant: &K, weight: u32) {
        let w = weight.max(1);
        match self.weights.get_mut(tenant) {
            Some(kept) if *kept == w => return,
            Some(kept) => *kept = w,
            None => {
                self.weights.insert(tenant.clone(), w);
            }
        }
        if let Some(&id) = self.ids.get(tenant) {
            self.tenants[id as usize].weight = w;
        }
    }

    /// Whether a push of `cost` into `tier` would be accepted now.
    #[inline]
    pub fn can_push(&self, tier: Tier, cost: u64) -> Result<(), PushRefusal> {
        if tier.0 >= self.limits.tiers {
            return Err(PushRefusal::NoSuchTier);
        }
        if self.len >= self.limits.max_len {
            return Err(PushRefusal::QueueFull);
        }
        if self.tokens.saturating_add(cost) > self.limits.max_tokens {
            return Err(PushRefusal::TokensFull);
        }
        Ok(())
    }

    fn intern(&mut self, tenant: &K) -> u32 {
        let cap = self.limits.max_len.saturating_mul(2).saturating_add(1024);
        if self.ids.len() >= cap {
            // Forget tenants with nothing queued (each loses at most one U of history).
            let tenants = &mut self.tenants;
            let free_ids = &mut self.free_ids;
            self.ids.retain(|_, id| {
                let rec = &mut tenants[*id as usize];
                if rec.live_total > 0 {
                    return true;
                }
                rec.key = None;
                rec.per_tier
                    .iter_mut()
                    .for_each(|t| *t = TenantQ::default());
                free_ids.push(*id);
                false
            });
        }
        let weight = self.weights.get(tenant).copied().unwrap_or(1);
        let id = match self.free_ids.pop() {
            Some(id) => {
                let rec = &mut self.tenants[id as usize];
                rec.key = Some(tenant.clone());
                rec.weight = weight;
                id
            }
            None => {
                self.tenants.push(TenantRec {
                    key: Some(tenant.clone()),
                    weight,
                    live_total: 0,
                    per_tier: (0..self.limits.tiers).map(|_| TenantQ::default()).collect(),
                });
                (self.tenants.len() - 1) as u32
            }
        };
        self.ids.insert(tenant.clone(), id);
        id
    }

    #[inline]
    fn peek_slot(&self, ticket: u64) -> Option<&Slot<T, K>> {
        let (idx, generation) = split(ticket);
        let s = self.slab.get(idx)?;
        if s.generation != generation {
            return None;
        }
        s.data.as_ref()
    }

    fn peek_slot_mut(&mut self, ticket: u64) -> Option<&mut Slot<T, K>> {
        let (idx, generation) = split(ticket);
        let s = self.slab.get_mut(idx)?;
        if s.generation != generation {
            return None;
        }
        s.data.as_mut()
    }

    #[inline]
    fn is_live(&self, ticket: u64) -> bool {
        let (idx, generation) = split(ticket);
        matches!(self.slab.get(idx), Some(s) if s.generation == generation && s.data.is_some())
    }

    /// Takes the slot's data out and frees the slot.
    #[inline]
    fn take(&mut self, ticket: u64) -> Option<Slot<T, K>> {
        let (idx, generation) = split(ticket);
        let s = self.slab.get_mut(idx)?;
        if s.generation != generation {
            return None;
        }
        let data = s.data.take()?;
        s.generation = s.generation.wrapping_add(1);
        self.free_slots.push(idx as u32);
        Some(data)
    }

    /// Drops stale deadline entries from the heap top (so `next_deadline` is exact) and
    /// compacts the heap when stale entries dominate.
    #[inline]
    fn tidy_deadlines(&mut self) {
        while let Some(Reverse((_, t))) = self.deadlines.peek() {
            if self.is_live(*t) {
                break;
            }
            self.deadlines.pop();
        }
        if self.deadlines.len() > 2 * self.len + 1024 {
            let slab = &self.slab;
            self.deadlines.retain(|Reverse((_, t))| {
                let (idx, generation) = split(*t);
                matches!(slab.get(idx), Some(s) if s.generation == generation && s.data.is_some())
            });
        }
    }

    /// Queues `item` for `tenant` in `tier` with token `cost`, expiring at `deadline`
    /// ([`Timestamp::MAX`] for never).
    pub fn push(
        &mut self,
        tier: Tier,
        tenant: K,
        cost: u64,
        now: Timestamp,
        deadline: Timestamp,
        item: T,
    ) -> Result<Ticket, Rejected<T>> {
        if let Err(reason) = self.can_push(tier, cost) {
            return Err(Rejected { reason, item });
        }
        let id = match self.ids.get(&tenant) {
            Some(&id) => id,
            None => self.intern(&tenant),
        };
        let idx = match self.free_slots.pop() {
            Some(i) => i as usize,
            None => {
                self.slab.push(SlabSlot {
                    generation: 0,
                    data: None,
                });
                self.slab.len() - 1
            }
        };
        let ticket = ((self.slab[idx].generation as u64) << 32) | idx as u64;
        let tq = &mut self.tiers[tier.0 as usize];
        let rec = &mut self.tenants[id as usize];
        let tt = &mut rec.per_tier[tier.0 as usize];
        if tt.live == 0 {
            tt.counter = tt.counter.max(tq.floor);
            tt.fifo.clear();
            tq.active.insert((tt.counter, id));
        }
        tt.fifo.push_back(ticket);
        if self.aging.is_some() {
            tq.order.push_back(ticket);
        }
        tt.live += 1;
        tt.tokens += cost;
        rec.live_total += 1;
        tq.len += 1;
        tq.tokens += cost;
        self.len += 1;
        self.tokens += cost;
        self.slab[idx].data = Some(Slot {
            tier: tier.0,
            tenant: id,
            key: tenant,
            cost,
            enqueued_at: now,
            deadline,
            passed: 0,
            item,
        });
        if deadline != Timestamp::MAX {
            self.deadlines.push(Reverse((deadline, ticket)));
        }
        Ok(Ticket(ticket))
    }

    /// Takes the next entry: the highest tier with entries, in it the backlogged tenant with
    /// the smallest virtual counter, from it the oldest entry. Deadlines are not checked;
    /// call [`FairQueue::expire`] first. Aging is not applied (it needs the time: see
    /// [`FairQueue::pop_ready`]).
    pub fn pop(&mut self) -> Option<Entry<T, K>> {
        self.pop_where(|_, _, _| Pick::Take)
    }

    /// Like [`FairQueue::pop`], but asks `judge` about each candidate in the fair order (the
    /// head entry of each backlogged tenant: its tier, tenant and cost). [`Pick::Take`] pops it;
    /// [`Pick::SkipTenant`] passes over that tenant (it is held back, e.g. over its fair
    /// share), so later tenants and lower tiers may go; [`Pick::Stop`] takes nothing (the
    /// candidate must go first but cannot go yet, e.g. no backend has room for it).
    /// Aging is not applied (see [`FairQueue::pop_ready`]).
    pub fn pop_where(
        &mut self,
        mut judge: impl FnMut(Tier, &K, u64) -> Pick,
    ) -> Option<Entry<T, K>> {
        self.pop_inner(None, None::<&mut Rank<T, K>>, |tier, k, cost, _| {
            judge(tier, k, cost)
        })
    }

    /// [`FairQueue::pop_where`] at `now`, with aging (when on): in each tier, the entries
    /// that have waited the aging horizon are offered first, oldest first, then the fair
    /// order. `judge` also sees the candidate's payload.
    pub fn pop_ready(
        &mut self,
        now: Timestamp,
        judge: impl FnMut(Tier, &K, u64, &T) -> Pick,
    ) -> Option<Entry<T, K>> {
        self.pop_inner(Some(now), None::<&mut Rank<T, K>>, judge)
    }

    /// [`FairQueue::pop_ready`], where a tenant's turn (in the fair order) offers not its
    /// oldest entry but the best-ranked of its [`PREFER_WINDOW`] oldest by `rank` (lower is
    /// better; the older on a tie, or the cheaper first with shortest-first on) — e.g. a
    /// request whose conversation the free backend still holds in its cache. Bound: each
    /// time a younger entry is taken this way, the tenant's oldest counts one pass; once it
    /// has [`PREFER_PASSES`], its tenant's next turn offers it regardless of rank. So an entry
    /// with `n` entries of its tenant and tier ahead of it leaves within
    /// `(n + 1) · (PREFER_PASSES + 1)` turns of its tenant in its tier; the fair order across
    /// tenants and aging are unchanged.
    pub fn pop_ready_preferring(
        &mut self,
        now: Timestamp,
        mut rank: impl FnMut(Tier, &K, u64, &T) -> u8,
        judge: impl FnMut(Tier, &K, u64, &T) -> Pick,
    ) -> Option<Entry<T, K>> {
        self.pop_inner(Some(now), Some(&mut rank), judge)
    }

    fn pop_inner<R: FnMut(Tier, &K, u64, &T) -> u8>(
        &mut self,
        now: Option<Timestamp>,
        mut rank: Option<&mut R>,
        mut judge: impl FnMut(Tier, &K, u64, &T) -> Pick,
    ) -> Option<Entry<T, K>> {
        let due_before = match (now, self.aging) {
            (Some(now), Some(h)) if now.saturating_duration_since(Timestamp::ZERO) >= h => {
                Some(now.saturating_sub(h))
            }
            _ => None,
        };
        let mut skipped: Vec<u32> = Vec::new();
        let mut chosen = None;
        let mut passed_over = None;
        'tiers: for ti in 0..self.tiers.len() {
            if self.tiers[ti].len == 0 {
                continue;
            }
            if let Some(due) = due_before {
                skipped.clear();
                match self.judge_aged(ti, due, &mut skipped, &mut judge) {
                    Some(Pick::Take) => {
                        let id = *skipped.last()?;
                        let counter = self.tenants[id as usize].per_tier[ti].counter;
                        // The tenant's oldest entry is the aged one offered.
                        let (ticket, _) = self.oldest(ti, id)?;
                        chosen = Some((ti, counter, id, true, ticket));
                        break 'tiers;
                    }
                    Some(_) => return None,
                    None => {}
                }
            }
            for &(counter, id) in &self.tiers[ti].active {
                if skipped.contains(&id) {
                    continue;
                }
                let Some((ticket, slot, oldest)) = self.candidate(ti, id, rank.as_deref_mut())
                else {
                    continue;
                };
                match judge(Tier(ti as u8), &slot.key, slot.cost, &slot.item) {
                    Pick::Take => {
                        chosen = Some((ti, counter, id, false, ticket));
                        passed_over = oldest;
                        break 'tiers;
                    }
                    Pick::SkipTenant => continue,
                    Pick::Stop => return None,
                }
            }
        }
        let (ti, counter, id, aged, ticket) = chosen?;
        if let Some(t) = passed_over.filter(|t| *t != ticket) {
            if let Some(s) = self.peek_slot_mut(t) {
                s.passed = s.passed.saturating_add(1);
            }
        }
        self.pop_entry(ti, counter, id, aged, ticket)
    }

    /// Tenant `id`'s live entries in tier `ti`, oldest first.
    fn live(&self, ti: usize, id: u32) -> impl Iterator<Item = (u64, &Slot<T, K>)> {
        self.tenants[id as usize].per_tier[ti]
            .fifo
            .iter()
            .filter_map(|t| self.peek_slot(*t).map(|s| (*t, s)))
    }

    /// Tenant `id`'s oldest live entry in tier `ti`.
    fn oldest(&self, ti: usize, id: u32) -> Option<(u64, &Slot<T, K>)> {
        self.live(ti, id).next()
    }

    /// The entry tenant `id`'s turn in tier `ti` takes: its oldest, or with shortest-first
    /// the cheapest of its [`SHORTEST_WINDOW`] oldest (the older on a tie), or with `rank`
    /// the best-ranked of its [`PREFER_WINDOW`] oldest (see
    /// [`FairQueue::pop_ready_preferring`]). With `rank`, also the oldest's ticket, to count
    /// a pass if another is taken.
    fn candidate<R: FnMut(Tier, &K, u64, &T) -> u8>(
        &self,
        ti: usize,
        id: u32,
        rank: Option<&mut R>,
    ) -> Option<(u64, &Slot<T, K>, Option<u64>)> {
        let mut live = self.live(ti, id);
        let Some(rank) = rank else {
            let (t, s) = if self.shortest_first {
                live.take(SHORTEST_WINDOW).min_by_key(|(_, s)| s.cost)?
            } else {
                live.next()?
            };
            return Some((t, s, None));
        };
        let mut live = live.take(PREFER_WINDOW);
        let (t0, s0) = live.next()?;
        let mut rank_of = |s: &Slot<T, K>| rank(Tier(ti as u8), &s.key, s.cost, &s.item);
        let r0 = rank_of(s0);
        if s0.passed >= PREFER_PASSES || (r0 == 0 && !self.shortest_first) {
            return Some((t0, s0, None));
        }
        let key = |r: u8, s: &Slot<T, K>| (r, if self.shortest_first { s.cost } else { 0 });
        let mut best = (key(r0, s0), t0, s0);
        for (t, s) in live {
            let k = key(rank_of(s), s);
            if k < best.0 {
                best = (k, t, s);
            }
        }
        Some((best.1, best.2, Some(t0)))
    }

    /// Offers tier `ti`'s entries pushed at or before `due` to `judge`, oldest first, each
    /// tenant once (its first entry in push order is its head). `Some(Take)`: the last id in
    /// `skipped` is the tenant to pop; `Some(Stop)`: pop nothing; `None`: no aged entry was
    /// taken (`skipped` then holds the tenants passed over).
    fn judge_aged(
        &mut self,
        ti: usize,
        due: Timestamp,
        skipped: &mut Vec<u32>,
        judge: &mut impl FnMut(Tier, &K, u64, &T) -> Pick,
    ) -> Option<Pick> {
        self.tidy_order(ti);
        let mut looked = 0;
        for &t in &self.tiers[ti].order {
            let Some(slot) = self.peek_slot(t) else {
                continue;
            };
            if slot.enqueued_at > due || looked >= AGING_WALK {
                break;
            }
            if skipped.contains(&slot.tenant) {
                continue;
            }
            looked += 1;
            match judge(Tier(ti as u8), &slot.key, slot.cost, &slot.item) {
                Pick::Take => {
                    skipped.push(slot.tenant);
                    return Some(Pick::Take);
                }
                Pick::SkipTenant => skipped.push(slot.tenant),
                Pick::Stop => return Some(Pick::Stop),
            }
        }
        None
    }

    /// Drops dead tickets from the front of tier `ti`'s push order, and compacts it when
    /// dead ones dominate.
    fn tidy_order(&mut self, ti: usize) {
        while let Some(&t) = self.tiers[ti].order.front() {
            if self.is_live(t) {
                break;
            }
            self.tiers[ti].order.pop_front();
        }
        let tq = &self.tiers[ti];
        if tq.order.len() > 2 * tq.len + 1024 {
            let slab = &self.slab;
            self.tiers[ti].order.retain(|t| {
                let (idx, generation) = split(*t);
                matches!(slab.get(idx), Some(s) if s.generation == generation && s.data.is_some())
            });
        }
    }

    /// Pops entry `ticket` of tenant `id` in tier `ti` (whose counter is `counter`). An aged
    /// pop (out of the fair order) does not raise the tier's floor to its counter.
    fn pop_entry(
        &mut self,
        ti: usize,
        counter: u128,
        id: u32,
        aged: bool,
        ticket: u64,
    ) -> Option<Entry<T, K>> {
        let slot = self.take(ticket)?;
        self.tiers[ti].active.remove(&(counter, id));
        {
            // Dead tickets leave the FIFO from its front; one taken from the middle (shortest
            // first) waits there until the FIFO is compacted.
            let slab = &self.slab;
            let live = |t: &u64| {
                let (idx, generation) = split(*t);
                matches!(slab.get(idx), Some(s) if s.generation == generation && s.data.is_some())
            };
            let tt = &mut self.tenants[id as usize].per_tier[ti];
            while tt.fifo.front().is_some_and(|t| !live(t)) {
                tt.fifo.pop_front();
            }
            if tt.fifo.len() > 2 * tt.live + 16 {
                tt.fifo.retain(|t| live(t));
            }
        }
        let tq = &mut self.tiers[ti];
        let rec = &mut self.tenants[id as usize];
        let tt = &mut rec.per_tier[ti];
        if !aged {
            tq.floor = tq.floor.max(counter);
        }
        tt.counter = counter + vcost(slot.cost, rec.weight);
        tt.live -= 1;
        tt.tokens -= slot.cost;
        rec.live_total -= 1;
        if tt.live > 0 {
            tq.active.insert((tt.counter, id));
        } else {
            tt.fifo.clear();
        }
        if let Some((c, _)) = tq.active.first() {
            tq.floor = tq.floor.max(*c);
        }
        tq.len -= 1;
        tq.tokens -= slot.cost;
        self.len -= 1;
        self.tokens -= slot.cost;
        if slot.deadline != Timestamp::MAX {
            self.tidy_deadlines();
        }
        if self.aging.is_some() {
            self.tidy_order(ti);
        }
        Some(Entry {
            ticket: Ticket(ticket),
            tier: Tier(slot.tier),
            tenant: slot.key,
            cost: slot.cost,
            enqueued_at: slot.enqueued_at,
            deadline: slot.deadline,
            item: slot.item,
        })
    }

    /// The newest entry of the tenant with the longest backlog in `tier`, if that backlog is
    /// longer than `tenant`'s own by more than one: `(ticket, cost)`. A full queue gives
    /// that place to a tenant with less waiting (longest-queue drop), so one tenant's
    /// backlog cannot lock its peers out of their tier.
    pub fn longest_backlog_newest(&self, tier: Tier, tenant: &K) -> Option<(Ticket, u64)> {
        let t = tier.0 as usize;
        let own = self
            .ids
            .get(tenant)
            .and_then(|&id| self.tenants.get(id as usize))
            .and_then(|r| r.per_tier.get(t))
            .map_or(0, |q| q.live);
        self.newest_of_longest(t, own + 1)
    }

    /// The newest entry of the longest backlog in the lowest tier below `tier` that has
    /// anything queued: `(ticket, cost)`. A full queue gives a higher tier's request the
    /// place of the least urgent one waiting (a bounded priority queue drops from the bottom).
    pub fn lowest_tier_newest(&self, tier: Tier) -> Option<(Ticket, u64)> {
        let below = (tier.0 as usize + 1).min(self.tiers.len());
        let lowest = (below..self.tiers.len())
            .rev()
            .find(|&t| self.tiers[t].len > 0)?;
        self.newest_of_longest(lowest, 0)
    }

    /// The newest live entry of the tenant with the longest backlog in tier `t`, if that
    /// backlog is longer than `floor`.
    fn newest_of_longest(&self, t: usize, floor: usize) -> Option<(Ticket, u64)> {
        let longest = self
            .tenants
            .iter()
            .filter_map(|r| r.per_tier.get(t))
            .max_by_key(|q| q.live)?;
        if longest.live <= floor {
            return None;
        }
        longest.fifo.iter().rev().find_map(|&ticket| {
            let (idx, generation) = split(ticket);
            match self.slab.get(idx) {
                Some(SlabSlot {
                    generation: g,
                    data: Some(slot),
                }) if *g == generation => Some((Ticket(ticket), slot.cost)),
                _ => None,
            }
        })
    }

    /// Removes the entry with `ticket` at once, if it is still queued.
    pub fn cancel(&mut self, ticket: Ticket) -> Option<Entry<T, K>> {
        let slot = self.take(ticket.0)?;
        let tq = &mut self.tiers[slot.tier as usize];
        let rec = &mut self.tenants[slot.tenant as usize];
        let tt = &mut rec.per_tier[slot.tier as usize];
        tt.live -= 1;
        tt.tokens -= slot.cost;
        rec.live_total -= 1;
        if tt.live == 0 {
            tq.active.remove(&(tt.counter, slot.tenant));
            tt.fifo.clear();
        } else if tt.fifo.len() > 2 * tt.live + 16 {
            let slab = &self.slab;
            tt.fifo.retain(|t| {
                let (idx, generation) = split(*t);
                matches!(slab.get(idx), Some(s) if s.generation == generation && s.data.is_some())
            });
        }
        tq.len -= 1;
        tq.tokens -= slot.cost;
        self.len -= 1;
        self.tokens -= slot.cost;
        if slot.deadline != Timestamp::MAX {
            self.tidy_deadlines();
        }
        Some(Entry {
            ticket,
            tier: Tier(slot.tier),
            tenant: slot.key,
            cost: slot.cost,
            enqueued_at: slot.enqueued_at,
            deadline: slot.deadline,
            item: slot.item,
        })
    }

    /// Removes and returns every entry whose deadline is at or before `now`, earliest first.
    pub fn expire(&mut self, now: Timestamp) -> Vec<Entry<T, K>> {
        let mut out = Vec::new();
        self.expire_into(now, &mut out);
        out
    }

    /// Like [`FairQueue::expire`], appending to `out` (no allocation when nothing expired).
    pub fn expire_into(&mut self, now: Timestamp, out: &mut Vec<Entry<T, K>>) {
        while let Some(Reverse((d, t))) = self.deadlines.peek().copied() {
            if d > now {
                break;
            }
            self.deadlines.pop();
            if let Some(e) = self.cancel(Ticket(t)) {
                out.push(e);
            }
        }
    }

    /// The earliest deadline queued, to schedule the next [`FairQueue::expire`].
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.deadlines.peek().map(|Reverse((d, _))| *d)
    }

    /// Entries queued.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if nothing is queued.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens queued.
    #[inline]
    pub fn queued_tokens(&self) -> u64 {
        self.tokens
    }

    /// Entries queued in tiers `0..=tier` (those a new `tier` entry would wait behind).
    #[inline]
    pub fn len_at_or_above(&self, tier: Tier) -> usize {
        self.tiers
            .iter()
            .take(tier.0 as usize + 1)
            .map(|t| t.len)
            .sum()
    }

    /// Charges `tenant` for `cost` served in `tier` without passing through the queue (a
    /// request dispatched at once), so that the fair order counts everything a tenant got:
    /// a tenant that filled the backends directly waits behind one that had nothing.
    pub fn charge(&mut self, tier: Tier, tenant: &K, cost: u64) {
        if tier.0 >= self.limits.tiers {
            return;
        }
        let id = match self.ids.get(tenant) {
            Some(&id) => id,
            None => self.intern(tenant),
        };
        let floor = self.tiers[tier.0 as usize].floor;
        let rec = &mut self.tenants[id as usize];
        let weight = rec.weight;
        let tt = &mut rec.per_tier[tier.0 as usize];
        if tt.live == 0 {
            tt.counter = tt.counter.max(floor) + vcost(cost, weight);
        } else {
            // Backlogged: its place in the active set is keyed by the counter.
            let tq = &mut self.tiers[tier.0 as usize];
            tq.active.remove(&(tt.counter, id));
            tt.counter += vcost(cost, weight);
            tq.active.insert((tt.counter, id));
        }
    }

    /// Where a new entry of `tenant` in `tier` would stand in the fair order: everything
    /// queued in higher tiers, plus, in its own tier, each backlogged tenant's entries up to
    /// the share that tenant gets before this one is reached (weighted round robin by count;
    /// the queue itself orders by token cost, so this is an estimate).
    pub fn position_estimate(&self, tier: Tier, tenant: &K) -> usize {
        let ti = tier.0 as usize;
        let Some(tq) = self.tiers.get(ti) else {
            return self.len;
        };
        let ahead: usize = self.tiers[..ti].iter().map(|t| t.len).sum();
        if tq.len == 0 {
            return ahead;
        }
        let own_id = self.ids.get(tenant).copied();
        let own_weight = self.weights.get(tenant).copied().unwrap_or(1).max(1) as u64;
        let own_live = own_id
            .map(|id| self.tenants[id as usize].per_tier[ti].live)
            .unwrap_or(0) as u64;
        // This entry is the tenant's (own_live + 1)-th; by then each other tenant of weight
        // w has had about (own_live + 1) · w / own_weight turns.
        let rounds = own_live + 1;
        let mut same_tier = own_live as usize;
        for &(_, id) in &tq.active {
            if Some(id) == own_id {
                continue;
            }
            let rec = &self.tenants[id as usize];
            let turns = (rounds * rec.weight.max(1) as u64).div_ceil(own_weight);
            same_tier += (rec.per_tier[ti].live as u64).min(turns) as usize;
        }
        ahead + same_tier
    }

    /// The place of a queued entry in the order [`FairQueue::pop`] would serve the queue as
    /// it stands (1 = next): every entry of a higher tier, then, in its own tier, the entries
    /// the virtual-token-counter order serves before it. Exact for the queue as it is now;
    /// later arrivals in higher tiers, or tenants skipped for their fair share, move it.
    /// `None` if the ticket is no longer queued. Costs O(n log t) for n entries ahead in
    /// its tier over t backlogged tenants.
    pub fn position_of(&self, ticket: Ticket) -> Option<usize> {
        let target = self.peek_slot(ticket.0)?;
        let ti = target.tier as usize;
        let ahead: usize = self.tiers[..ti].iter().map(|t| t.len).sum();
        // Replay the tier's pops on a copy of the counters: the smallest counter goes, its
        // counter grows by its head entry's cost over its weight.
        let mut order: BTreeSet<(u128, u32)> = self.tiers[ti].active.clone();
        let mut cursor: HashMap<u32, usize, FastState> = HashMap::default();
        let mut served = 0usize;
        while let Some((counter, id)) = order.pop_first() {
            let rec = &self.tenants[id as usize];
            let fifo = &rec.per_tier[ti].fifo;
            let at = cursor.entry(id).or_insert(0);
            let next = fifo
                .range(*at..)
                .enumerate()
                .find_map(|(i, t)| self.peek_slot(*t).map(|s| (i, *t, s.cost)));
            let Some((skip, t, cost)) = next else {
                continue;
            };
            if t == ticket.0 {
                return Some(ahead + served + 1);
            }
            served += 1;
            *at += skip + 1;
            order.insert((counter + vcost(cost, rec.weight), id));
        }
        None
    }

    /// Whether `ticket` is still queued.
    pub fn contains(&self, ticket: Ticket) -> bool {
        self.is_live(ticket.0)
    }

    /// Figures for metrics.
    pub fn stats(&self) -> QueueStats {
        QueueStats {
            len: self.len,
            tokens: self.tokens,
            tiers: self
                .tiers
                .iter()
                .map(|t| TierStats {
                    len: t.len,
                    tokens: t.tokens,
                    backlogged_tenants: t.active.len(),
                })
                .collect(),
        }
    }

    /// A tenant's backlog, one line per tier where it has entries.
    pub fn tenant_backlog(&self, tenant: &K) -> Vec<TenantBacklog> {
        let Some(&id) = self.ids.get(tenant) else {
            return Vec::new();
        };
        self.tenants[id as usize]
            .per_tier
            .iter()
            .enumerate()
            .filter(|(_, t)| t.live > 0)
            .map(|(i, t)| TenantBacklog {
                tier: Tier(i as u8),
                len: t.live,
                tokens: t.tokens,
            })
            .collect()
    }

    /// Every backlogged tenant: `(tier, tenant, entries, tokens)`, for per-tenant metrics.
    pub fn backlogged(&self) -> impl Iterator<Item = (Tier, &K, usize, u64)> + '_ {
        self.tenants
            .iter()
            .filter(|r| r.live_total > 0)
            .flat_map(|r| {
                r.per_tier
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| t.live > 0)
                    .filter_map(move |(i, t)| {
                        r.key.as_ref().map(|k| (Tier(i as u8), k, t.live, t.tokens))
                    })
            })
    }

    /// A tenant's virtual counter in a tier (for tests and debugging).
    #[doc(hidden)]
    pub fn virtual_counter(&self, tier: Tier, tenant: &K) -> Option<u128> {
        let id = *self.ids.get(tenant)?;
        self.tenants[id as usize]
            .per_tier
            .get(tier.0 as usize)
            .map(|t| t.counter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(max_len: usize, max_tokens: u64) -> FairQueue<u32, &'static str> {
        FairQueue::new(QueueLimits {
            tiers: 3,
            max_len,
            max_tokens,
        })
    }

    const T0: Timestamp = Timestamp::ZERO;

    #[test]
    fn strict_priority_then_fifo() {
        let mut fq = q(100, 1_000_000);
        fq.push(Tier(2), "a", 10, T0, Timestamp::MAX, 1).unwrap();
        fq.push(Tier(0), "a", 10, T0, Timestamp::MAX, 2).unwrap();
        fq.push(Tier(1), "a", 10, T0, Timestamp::MAX, 3).unwrap();
        fq.push(Tier(0), "a", 10, T0, Timestamp::MAX, 4).unwrap();
        let order: Vec<u32> = std::iter::from_fn(|| fq.pop().map(|e| e.item)).collect();
        assert_eq!(order, vec![2, 4, 3, 1]);
    }

    #[test]
    fn bounds_refuse_with_reason() {
        let mut fq = q(2, 100);
        fq.push(Tier(0), "a", 60, T0, Timestamp::MAX, 1).unwrap();
        let r = fq
            .push(Tier(0), "a", 50, T0, Timestamp::MAX, 2)
            .unwrap_err();
        assert_eq!(r.reason, PushRefusal::TokensFull);
        assert_eq!(r.item, 2);
        fq.push(Tier(0), "a", 40, T0, Timestamp::MAX, 3).unwrap();
        assert_eq!(
            fq.push(Tier(0), "b", 0, T0, Timestamp::MAX, 4)
                .unwrap_err()
                .reason,
            PushRefusal::QueueFull
        );
        assert_eq!(
            fq.push(Tier(7), "b", 0, T0, Timestamp::MAX, 5)
                .unwrap_err()
                .reason,
            PushRefusal::NoSuchTier
        );
    }

    #[test]
    fn vtc_alternates_by_cost() {
        let mut fq = q(1000, 1_000_000);
        // a sends big requests, b small ones; b should get several per a.
        for i in 0..10 {
            fq.push(Tier(0), "a", 100, T0, Timestamp::MAX, i).unwrap();
        }
        for i in 100..200 {
            fq.push(Tier(0), "b", 10, T0, Timestamp::MAX, i).unwrap();
        }
        let mut served_a = 0u64;
        let mut served_b = 0u64;
        for _ in 0..50 {
            let e = fq.pop().unwrap();
            if e.tenant == "a" {
                served_a += e.cost;
            } else {
                served_b += e.cost;
            }
            assert!(served_a.abs_diff(served_b) <= 200);
        }
    }

    #[test]
    fn weights_divide_cost() {
        let mut fq = q(1000, 1_000_000);
        fq.set_weight(&"heavy", 3);
        for i in 0..300 {
            fq.push(Tier(0), "heavy", 10, T0, Timestamp::MAX, i)
                .unwrap();
            fq.push(Tier(0), "light", 10, T0, Timestamp::MAX, i)
                .unwrap();
        }
        let mut h = 0;
        for _ in 0..200 {
            if fq.pop().unwrap().tenant == "heavy" {
                h += 1;
            }
        }
        assert!((148..=152).contains(&h), "heavy got {h} of 200");
    }

    #[test]
    fn newcomer_is_lifted_not_favoured() {
        let mut fq = q(1000, 1_000_000);
        for i in 0..100 {
            fq.push(Tier(0), "a", 10, T0, Timestamp::MAX, i).unwrap();
        }
        for _ in 0..50 {
            fq.pop().unwrap();
        }
        // b arrives late with many requests: it alternates with a rather than taking 50 turns.
        for i in 0..100 {
            fq.push(Tier(0), "b", 10, T0, Timestamp::MAX, i).unwrap();
        }
        let firsts: Vec<_> = (0..10).map(|_| fq.pop().unwrap().tenant).collect();
        let bs = firsts.iter().filter(|t| **t == "b").count();
        assert!((4..=6).contains(&bs), "{firsts:?}");
    }

    #[test]
    fn cancel_and_expire() {
        let mut fq = q(100, 1000);
        let ms = std::time::Duration::from_millis;
        let t1 = fq.push(Tier(0), "a", 10, T0, T0 + ms(100), 1).unwrap();
        let t2 = fq.push(Tier(0), "a", 10, T0, T0 + ms(50), 2).unwrap();
        let _t3 = fq.push(Tier(0), "b", 10, T0, T0 + ms(200), 3).unwrap();
        assert_eq!(fq.next_deadline(), Some(T0 + ms(50)));
        assert_eq!(fq.cancel(t1).unwrap().item, 1);
        assert!(fq.cancel(t1).is_none());
        assert_eq!(fq.len(), 2);
        assert_eq!(fq.queued_tokens(), 20);
        let ex = fq.expire(T0 + ms(60));
        assert_eq!(ex.len(), 1);
        assert_eq!(ex[0].ticket, t2);
        assert_eq!(fq.pop().unwrap().item, 3);
        assert!(fq.pop().is_none());
        assert_eq!(fq.stats().tokens, 0);
    }

    #[test]
    fn aging_lets_a_light_tenant_through_a_heavy_load() {
        let ms = std::time::Duration::from_millis;
        let run = |aging: Option<std::time::Duration>| {
            let mut fq = q(10_000, u64::MAX);
            fq.set_weight(&"heavy", 100);
            fq.set_aging(aging);
            // The light tenant, served a while ago, has one request waiting in front of a
            // heavy backlog that grows by one request per pop; each pop takes 1 ms.
            fq.charge(Tier(0), &"light", 2000);
            fq.push(Tier(0), "light", 10, T0, Timestamp::MAX, 999)
                .unwrap();
            for i in 0..50 {
                fq.push(Tier(0), "heavy", 10, T0, Timestamp::MAX, i)
                    .unwrap();
            }
            let mut now = T0;
            for n in 0..500u32 {
                now = now + ms(1);
                fq.push(Tier(0), "heavy", 10, now, Timestamp::MAX, 1000 + n)
                    .unwrap();
                let e = fq.pop_ready(now, |_, _, _, _| Pick::Take).unwrap();
                if e.tenant == "light" {
                    return Some(n);
                }
            }
            None
        };
        // Without aging it waits until heavy's counter catches up with light's: 20 000
        // heavy turns (2000 tokens at 10 / 100 per turn), far past these 500 pops.
        assert_eq!(run(None), None);
        // With a 20 ms horizon it goes at the first pop after 20 ms.
        assert_eq!(run(Some(ms(20))), Some(19));
    }

    #[test]
    fn aged_entries_go_oldest_first_and_skipped_tenants_stay_back() {
        let ms = std::time::Duration::from_millis;
        let mut fq = q(100, u64::MAX);
        fq.set_aging(Some(ms(10)));
        fq.push(Tier(0), "a", 10, T0, Timestamp::MAX, 1).unwrap();
        fq.push(Tier(0), "b", 10, T0 + ms(1), Timestamp::MAX, 2)
            .unwrap();
        fq.push(Tier(0), "c", 10, T0 + ms(2), Timestamp::MAX, 3)
            .unwrap();
        // a is held back by the judge: b (the next oldest) goes.
        let e = fq
            .pop_ready(T0 + ms(20), |_, k, _, _| {
                if *k == "a" {
                    Pick::SkipTenant
                } else {
                    Pick::Take
                }
            })
            .unwrap();
        assert_eq!(e.item, 2);
        // Before the horizon, the fair order (counters: c never served, a never served).
        let mut fresh = q(100, u64::MAX);
        fresh.set_aging(Some(ms(10)));
        fresh.charge(Tier(0), &"a", 100);
        fresh.push(Tier(0), "a", 10, T0, Timestamp::MAX, 1).unwrap();
        fresh
            .push(Tier(0), "b", 10, T0 + ms(1), Timestamp::MAX, 2)
            .unwrap();
        assert_eq!(
            fresh
                .pop_ready(T0 + ms(5), |_, _, _, _| Pick::Take)
                .unwrap()
                .item,
            2
        );
        fresh
            .push(Tier(0), "b", 10, T0 + ms(6), Timestamp::MAX, 3)
            .unwrap();
        // At the horizon a's entry (pushed first) outranks b's smaller counter.
        assert_eq!(
            fresh
                .pop_ready(T0 + ms(10), |_, _, _, _| Pick::Take)
                .unwrap()
                .item,
            1
        );
    }

    #[test]
    fn shortest_first_inside_a_tenant_fair_order_across() {
        let mut fq = q(100, u64::MAX);
        for (i, cost) in [(1, 50), (2, 10), (3, 30)] {
            fq.push(Tier(0), "a", cost, T0, Timestamp::MAX, i).unwrap();
        }
        fq.push(Tier(0), "b", 20, T0, Timestamp::MAX, 9).unwrap();
        let order = |fq: &mut FairQueue<u32, &'static str>| -> Vec<u32> {
            std::iter::from_fn(|| fq.pop_ready(T0, |_, _, _, _| Pick::Take).map(|e| e.item))
                .collect()
        };
        let mut fifo = q(100, u64::MAX);
        for (i, cost) in [(1, 50), (2, 10), (3, 30)] {
            fifo.push(Tier(0), "a", cost, T0, Timestamp::MAX, i)
                .unwrap();
        }
        fifo.push(Tier(0), "b", 20, T0, Timestamp::MAX, 9).unwrap();
        assert_eq!(order(&mut fifo), vec![1, 9, 2, 3]);
        fq.set_shortest_first(true);
        // a's turns take its cheapest first; b's turn comes where the counters put it.
        assert_eq!(order(&mut fq), vec![2, 9, 3, 1]);
        assert!(fq.is_empty());
        assert_eq!(fq.queued_tokens(), 0);
    }

    #[test]
    fn preferring_passes_the_oldest_a_bounded_number_of_times() {
        let mut fq = q(100, u64::MAX);
        for i in 0..20u32 {
            fq.push(Tier(0), "a", 1, T0, Timestamp::MAX, i).unwrap();
        }
        fq.push(Tier(0), "b", 1, T0, Timestamp::MAX, 100).unwrap();
        // Entry 0 ranks worst; every other ranks best.
        let mut order = Vec::new();
        while let Some(e) = fq.pop_ready_preferring(
            T0,
            |_, _, _, i| if *i == 0 { 2 } else { 0 },
            |_, _, _, _| Pick::Take,
        ) {
            order.push(e.item);
        }
        // The fair order across tenants is unchanged: b's turn comes second.
        assert_eq!(order[1], 100);
        let a: Vec<u32> = order.into_iter().filter(|i| *i < 100).collect();
        let passes = PREFER_PASSES as u32;
        // a's oldest is passed over PREFER_PASSES times, then taken.
        let mut want: Vec<u32> = (1..=passes).collect();
        want.push(0);
        want.extend(passes + 1..20);
        assert_eq!(a, want);
    }

    #[test]
    fn preferring_ranks_only_the_window_and_ties_go_oldest() {
        let mut fq = q(100, u64::MAX);
        for i in 0..(PREFER_WINDOW as u32 + 4) {
            fq.push(Tier(0), "a", 1, T0, Timestamp::MAX, i).unwrap();
        }
        let best = PREFER_WINDOW as u32 + 1;
        let pop = |fq: &mut FairQueue<u32, &'static str>| {
            fq.pop_ready_preferring(
                T0,
                |_, _, _, i| match *i {
                    i if i == best => 0,
                    3 | 5 => 1,
                    _ => 2,
                },
                |_, _, _, _| Pick::Take,
            )
            .map(|e| e.item)
        };
        // The best-ranked entry is outside the window: the better of the rest, oldest first.
        assert_eq!(pop(&mut fq), Some(3));
        assert_eq!(pop(&mut fq), Some(5));
    }
}
