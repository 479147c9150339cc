//! Hooks for tests; not part of the stable API.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static POISON: AtomicBool = AtomicBool::new(false);

/// Fill the fused kernels' outputs with NaN before each launch (process-wide), so that a
/// result the kernel forgot to write shows up as NaN in tests instead of stale memory.
///
/// # Example
///
/// ```
/// burn_flash::testing::poison_outputs(true);
/// // ... run attention and check the outputs ...
/// burn_flash::testing::poison_outputs(false);
/// ```
pub fn poison_outputs(enabled: bool) {
    POISON.store(enabled, Ordering::Relaxed);
}

/// Whether [`poison_outputs`] is on; read by the kernel launcher.
pub(crate) fn poison_enabled() -> bool {
    POISON.load(Ordering::Relaxed)
}

static FORCED_ATOMIC_DQ: AtomicUsize = AtomicUsize::new(0);

/// While the returned guard lives, a backward asked for a non-deterministic dQ
/// (`with_deterministic(false)`) takes the atomic dQ wherever the runtime can run it, on either
/// tile, instead of the faster of the two for the shape: tests use it to cover the atomic path
/// on small shapes, where the separate dQ launch is faster, and on the portable tile, whose
/// per-unit atomics are always slower. Guards nest and may live on several threads at once.
///
/// # Example
///
/// ```
/// let atomic = burn_flash::testing::force_atomic_dq();
/// // ... run backwards with `with_deterministic(false)` ...
/// drop(atomic);
/// ```
#[must_use = "the atomic dQ is forced only while the guard lives"]
pub fn force_atomic_dq() -> ForcedAtomicDq {
    ForcedAtomicDq {
        _held: Held::new(&FORCED_ATOMIC_DQ),
    }
}

/// Guard of [`force_atomic_dq`].
pub struct ForcedAtomicDq {
    _held: Held,
}

/// Whether some [`force_atomic_dq`] guard lives; read by the backward launcher.
pub(crate) fn atomic_dq_forced() -> bool {
    Held::any(&FORCED_ATOMIC_DQ)
}

static FORCED_WIDE_INDICES: AtomicUsize = AtomicUsize::new(0);

/// While the returned guard lives, every kernel this crate launches indexes with 64 bits, as
/// it does for tensors of more than `u32::MAX` elements, so that tests cover that build on
/// small shapes. Guards nest and may live on several threads at once; the switch is
/// process-wide.
///
/// # Example
///
/// ```
/// let wide = burn_flash::testing::force_wide_indices();
/// // ... run attention on small shapes ...
/// drop(wide);
/// ```
#[must_use = "64-bit indices are forced only while the guard lives"]
pub fn force_wide_indices() -> ForcedWideIndices {
    ForcedWideIndices {
        _held: Held::new(&FORCED_WIDE_INDICES),
    }
}

/// Guard of [`force_wide_indices`].
pub struct ForcedWideIndices {
    _held: Held,
}

/// Whether some [`force_wide_indices`] guard lives; read where launches pick their index width.
pub(crate) fn wide_indices_forced() -> bool {
    Held::any(&FORCED_WIDE_INDICES)
}

/// One live guard counted in `count`, so that guards nest and may live on several threads.
struct Held(&'static AtomicUsize);

impl Held {
    fn new(count: &'static AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }

    /// Whether some guard counted in `count` lives.
    fn any(count: &AtomicUsize) -> bool {
        count.load(Ordering::SeqCst) > 0
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

static ATOMIC_DQ: AtomicUsize = AtomicUsize::new(0);
static SEPARATE_DQ: AtomicUsize = AtomicUsize::new(0);

/// How many fused backwards of this process have computed dQ by f32 atomics and how many by its
/// own deterministic launch, so tests can tell which path ran.
///
/// # Example
///
/// ```
/// let (atomic, deterministic) = burn_flash::testing::dq_launches();
/// assert_eq!((atomic, deterministic), (0, 0)); // no backward ran yet
/// ```
pub fn dq_launches() -> (usize, usize) {
    (
        ATOMIC_DQ.load(Ordering::Relaxed),
        SEPARATE_DQ.load(Ordering::Relaxed),
    )
}

/// Counts one fused backward for [`dq_launches`].
pub(crate) fn record_dq_launch(atomic: bool) {
    let counter = if atomic { &ATOMIC_DQ } else { &SEPARATE_DQ };
    counter.fetch_add(1, Ordering::Relaxed);
}

static AVOIDED_TMA: AtomicUsize = AtomicUsize::new(0);

/// While the returned guard lives, the forward and the backward stage their blocks by per-unit
/// asynchronous copies even where they would use tensor maps (SM90 and newer, head dims 64 and
/// 128), so that tests cover on such a GPU the path older ones take. Guards nest and may live on
/// several threads at once.
///
/// # Example
///
/// ```
/// let copies = burn_flash::testing::avoid_tma();
/// // ... run attention forwards and backwards ...
/// drop(copies);
/// ```
#[must_use = "tensor maps are avoided only while the guard lives"]
pub fn avoid_tma() -> AvoidedTma {
    AvoidedTma {
        _held: Held::new(&AVOIDED_TMA),
    }
}

/// Guard of [`avoid_tma`].
pub struct AvoidedTma {
    _held: Held,
}

/// Whether some [`avoid_tma`] guard lives; read by the launchers.
pub(crate) fn tma_avoided() -> bool {
    Held::any(&AVOIDED_TMA)
}

static TMA_STAGED: AtomicUsize = AtomicUsize::new(0);

/// How many forward and dK/dV launches of this process have staged their blocks by tensor
/// maps, so tests can tell that the path ran.
///
/// # Example
///
/// ```
/// assert_eq!(burn_flash::testing::tma_launches(), 0); // no attention ran yet
/// ```
pub fn tma_launches() -> usize {
    TMA_STAGED.load(Ordering::Relaxed)
}

/// Counts one launch staged by tensor maps for [`tma_launches`].
pub(crate) fn record_tma_launch() {
    TMA_STAGED.fetch_add(1, Ordering::Relaxed);
}

static FORCED_WARPGROUP_BACKWARD: AtomicUsize = AtomicUsize::new(0);

/// While the returned guard lives, backwards with the atomic dQ take the Hopper backward on
/// warpgroup products wherever it can run (SM90, head dims 64 and 128, plain or causal; by
/// default only at head dim 128: see `docs/hopper.md`), as `BURN_FLASH_WARPGROUP_BACKWARD=1`
/// does for a process. Guards nest and may live on several threads at once.
///
/// # Example
///
/// ```
/// let hopper = burn_flash::testing::force_warpgroup_backward();
/// // ... run attention backwards with the atomic dQ ...
/// drop(hopper);
/// ```
#[must_use = "the warpgroup backward is forced only while the guard lives"]
pub fn force_warpgroup_backward() -> ForcedWarpgroupBackward {
    ForcedWarpgroupBackward {
        _held: Held::new(&FORCED_WARPGROUP_BACKWARD),
    }
}

/// Guard of [`force_warpgroup_backward`].
pub struct ForcedWarpgroupBackward {
    _held: Held,
}

/// Whether some [`force_warpgroup_backward`] guard lives; read by the backward's plan.
pub(crate) fn warpgroup_backward_forced() -> bool {
    Held::any(&FORCED_WARPGROUP_BACKWARD)
}

static FORCED_WARPGROUP_INPUTS: AtomicUsize = AtomicUsize::new(0);

/// While the returned guard lives, forwards with a boolean mask of a row per query or an
/// additive bias of a row per query (over keys in whole 16 bytes) take the Hopper forward on
/// warpgroup products wherever it can run (SM90, head dims 64 and 128, plain or causal), as
/// `BURN_FLASH_WARPGROUP_INPUTS=1` does for a process; by default biases at head dim 64 take
/// the tensor-core tile. Guards nest and may live on several threads at once.
///
/// # Example
///
/// ```
/// let hopper = burn_flash::testing::force_warpgroup_inputs();
/// // ... run masked or biased attention forwards ...
/// drop(hopper);
/// ```
#[must_use = "the warpgroup forward's inputs are forced only while the guard lives"]
pub fn force_warpgroup_inputs() -> ForcedWarpgroupInputs {
    ForcedWarpgroupInputs {
        _held: Held::new(&FORCED_WARPGROUP_INPUTS),
    }
}

/// Guard of [`force_warpgroup_inputs`].
pub struct ForcedWarpgroupInputs {
    _held: Held,
}

/// Whether some [`force_warpgroup_inputs`] guard lives; read by the forward's plan.
pub(crate) fn warpgroup_inputs_forced() -> bool {
    Held::any(&FORCED_WARPGROUP_INPUTS)
}

static WARPGROUP_FORWARDS: AtomicUsize = AtomicUsize::new(0);

/// How many forwards of this process have run on Hopper's warpgroup products, so tests can
/// tell that the path ran.
///
/// # Example
///
/// ```
/// assert_eq!(burn_flash::testing::warpgroup_forward_launches(), 0); // no forward ran yet
/// ```
pub fn warpgroup_forward_launches() -> usize {
    WARPGROUP_FORWARDS.load(Ordering::Relaxed)
}

/// Counts one forward on warpgroup products for [`warpgroup_forward_launches`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn record_warpgroup_forward() {
    WARPGROUP_FORWARDS.fetch_add(1, Ordering::Relaxed);
}

static AVOIDED_WARPGROUP_BACKWARD: AtomicUsize = AtomicUsize::new(0);

/// While the returned guard lives (and no [`force_warpgroup_backward`] guard does), backwards
/// with the atomic dQ run the tensor-core tile's dK/dV launch even where the Hopper backward
/// would be the default (SM90, head dim 128), as `BURN_FLASH_WARPGROUP_BACKWARD=0` does for a
/// process: the SM80 path, covered on such a GPU. Guards nest and may live on several threads at
/// once.
///
/// # Example
///
/// ```
/// let tile = burn_flash::testing::avoid_warpgroup_backward();
/// // ... run attention backwards with the atomic dQ ...
/// drop(tile);
/// ```
#[must_use = "the warpgroup backward is avoided only while the guard lives"]
pub fn avoid_warpgroup_backward() -> AvoidedWarpgroupBackward {
    AvoidedWarpgroupBackward {
        _held: Held::new(&AVOIDED_WARPGROUP_BACKWARD),
    }
}

/// Guard of [`avoid_warpgroup_backward`].
pub struct AvoidedWarpgroupBackward {
    _held: Held,
}

/// Whether some [`avoid_warpgroup_backward`] guard lives; read by the backward's plan.
pub(crate) fn warpgroup_backward_avoided() -> bool {
    Held::any(&AVOIDED_WARPGROUP_BACKWARD)
}

static WARPGROUP_BACKWARDS: AtomicUsize = AtomicUsize::new(0);

/// How many backwards of this process have run on Hopper's warpgroup products (by default at
/// head dim 128, or [`force_warpgroup_backward`]), so tests can tell that the path ran.
///
/// # Example
///
/// ```
/// assert_eq!(burn_flash::testing::warpgroup_backward_launches(), 0); // no backward ran yet
/// ```
pub fn warpgroup_backward_launches() -> usize {
    WARPGROUP_BACKWARDS.load(Ordering::Relaxed)
}

/// Counts one backward on warpgroup products for [`warpgroup_backward_launches`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn record_warpgroup_backward() {
    WARPGROUP_BACKWARDS.fetch_add(1, Ordering::Relaxed);
}

static WIDE_FORWARDS: AtomicUsize = AtomicUsize::new(0);

/// How many forward launches of this process have indexed with 64 bits (tensors of more than
/// `u32::MAX` elements, or [`force_wide_indices`]), so tests can tell which width a call took.
///
/// # Example
///
/// ```
/// assert_eq!(burn_flash::testing::wide_forward_launches(), 0); // no attention ran yet
/// ```
pub fn wide_forward_launches() -> usize {
    WIDE_FORWARDS.load(Ordering::Relaxed)
}

/// Counts one 64-bit forward launch for [`wide_forward_launches`].
pub(crate) fn record_wide_forward() {
    WIDE_FORWARDS.fetch_add(1, Ordering::Relaxed);
}

static FORCED_THREE_KV_STAGES: AtomicUsize = AtomicUsize::new(0);

/// While the returned guard lives, decoding forwards (at most 16 query rows a key/value head)
/// whose keys and values tensor maps stage cycle them through three shared-memory stages, two
/// blocks in flight while one is computed, as `BURN_FLASH_KV_STAGES=3` does for a process; by
/// default they take two (`docs/forward.md`, "Block shapes"). Guards nest and may live on
/// several threads at once.
///
/// # Example
///
/// ```
/// let three = burn_flash::testing::force_three_kv_stages();
/// // ... run decoding forwards ...
/// drop(three);
/// ```
#[must_use = "three stages are forced only while the guard lives"]
pub fn force_three_kv_stages() -> ForcedThreeKvStages {
    ForcedThreeKvStages {
        _held: Held::new(&FORCED_THREE_KV_STAGES),
    }
}

/// Guard of [`force_three_kv_stages`].
pub struct ForcedThreeKvStages {
    _held: Held,
}

/// Whether some [`force_three_kv_stages`] guard lives; read by the decode plan.
pub(crate) fn three_kv_stages_forced() -> bool {
    Held::any(&FORCED_THREE_KV_STAGES)
}

static THREE_STAGE_FORWARDS: AtomicUsize = AtomicUsize::new(0);

/// How many forward launches of this process have staged keys and values three deep (under
/// [`force_three_kv_stages`] or `BURN_FLASH_KV_STAGES=3`), so tests can tell that the path ran.
///
/// # Example
///
/// ```
/// assert_eq!(burn_flash::testing::three_stage_forward_launches(), 0); // no attention ran yet
/// ```
pub fn three_stage_forward_launches() -> usize {
    THREE_STAGE_FORWARDS.load(Ordering::Relaxed)
}

/// Counts one three-stage forward launch for [`three_stage_forward_launches`].
pub(crate) fn record_three_stage_forward() {
    THREE_STAGE_FORWARDS.fetch_add(1, Ordering::Relaxed);
}

static FORWARD_LAUNCH_NANOS: AtomicU64 = AtomicU64::new(0);

/// Host time this process's forward launches have taken, in all: planning, allocating the
/// outputs, building the tensor maps and enqueueing the kernels (not the kernels' run), so a
/// benchmark can tell it from the device's time where calls are short (decoding).
///
/// # Example
///
/// ```
/// let before = burn_flash::testing::forward_launch_time();
/// // ... attention forwards ...
/// let spent = burn_flash::testing::forward_launch_time() - before;
/// # assert!(spent.is_zero());
/// ```
pub fn forward_launch_time() -> Duration {
    Duration::from_nanos(FORWARD_LAUNCH_NANOS.load(Ordering::Relaxed))
}

/// Adds the time from its start to its drop to [`forward_launch_time`]: one launch, whichever
/// way it returns.
pub(crate) struct ForwardLaunchTimer(Instant);

impl ForwardLaunchTimer {
    pub(crate) fn start() -> Self {
        Self(Instant::now())
    }
}

impl Drop for ForwardLaunchTimer {
    fn drop(&mut self) {
        let spent = self.0.elapsed().as_nanos() as u64;
        FORWARD_LAUNCH_NANOS.fetch_add(spent, Ordering::Relaxed);
    }
}

static VIEWS_IN_PLACE: AtomicUsize = AtomicUsize::new(0);

/// How many non-contiguous key and value inputs (views, such as a cache's filled prefix) the
/// forwards of this process have read in place, without a copy, so tests can tell that a view
/// reached the kernel as one.
///
/// # Example
///
/// ```
/// assert_eq!(burn_flash::testing::views_read_in_place(), 0); // no attention ran yet
/// ```
pub fn views_read_in_place() -> usize {
    VIEWS_IN_PLACE.load(Ordering::Relaxed)
}

/// Counts one input for [`views_read_in_place`].
pub(crate) fn record_view_in_place() {
    VIEWS_IN_PLACE.fetch_add(1, Ordering::Relaxed);
}

/// The slot count [`tail_slots`] forces; `usize::MAX` while none is.
static FORCED_TAIL_SLOTS: AtomicUsize = AtomicUsize::new(usize::MAX);
/// Held by the live [`tail_slots`] guard, so that two never overlap.
static TAIL_SLOTS_HELD: Mutex<()> = Mutex::new(());

/// While the returned guard lives, every dK/dV launch plans its last wave for `slots` cube
/// slots, on either tile, dQ by atomics or not, band or not: its last `cubes % slots` cubes then
/// walk in pieces where the slots leave room for two or more each, and their partial dK/dV sums
/// are added by a launch of their own (`slots = 0` splits nothing). By default only the tensor-
/// core single pass without a band splits, over the GPU's SMs. A second guard waits for the
/// first to drop; launches on other threads meanwhile plan with the forced count too, so a test
/// that compares bits between calls holds `tail_slots(0)` while it runs (a split launch sums in
/// another order).
///
/// # Example
///
/// ```
/// let split = burn_flash::testing::tail_slots(8);
/// // ... run backwards: a grid of 13 cubes walks 8 whole, 5 in pieces ...
/// drop(split);
/// ```
#[must_use = "the slot count is forced only while the guard lives"]
pub fn tail_slots(slots: usize) -> TailSlots {
    let held = TAIL_SLOTS_HELD
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    FORCED_TAIL_SLOTS.store(slots, Ordering::SeqCst);
    TailSlots { _held: held }
}

/// Guard of [`tail_slots`].
pub struct TailSlots {
    _held: MutexGuard<'static, ()>,
}

impl Drop for TailSlots {
    fn drop(&mut self) {
        FORCED_TAIL_SLOTS.store(usize::MAX, Ordering::SeqCst);
    }
}

/// The slot count a live [`tail_slots`] guard forces; read by the backward launcher.
pub(crate) fn forced_tail_slots() -> Option<usize> {
    Some(FORCED_TAIL_SLOTS.load(Ordering::SeqCst)).filter(|&slots| slots != usize::MAX)
}

static TAIL_SPLITS: AtomicUsize = AtomicUsize::new(0);

/// How many dK/dV launches of this process have split their last wave's cubes into pieces
/// ([`tail_slots`]), so tests can tell that the path ran.
///
/// # Example
///
/// ```
/// assert_eq!(burn_flash::testing::tail_splits(), 0); // no backward ran yet
/// ```
pub fn tail_splits() -> usize {
    TAIL_SPLITS.load(Ordering::Relaxed)
}

/// Counts one split launch for [`tail_splits`].
pub(crate) fn record_tail_split() {
    TAIL_SPLITS.fetch_add(1, Ordering::Relaxed);
}

thread_local! {
    static PADDED_HEAD_DIMS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// While the returned guard lives, attention calls made on this thread pad head dims the
/// tensor-core tile is not built for ([`FlashAttentionPlan::FusedPadded`]) on any tile, so that
/// the padding is tested where the portable tile would run them as they are (wgpu). Other
/// threads are not affected.
///
/// [`FlashAttentionPlan::FusedPadded`]: crate::FlashAttentionPlan::FusedPadded
///
/// # Example
///
/// ```
/// let padded = burn_flash::testing::pad_head_dims();
/// // ... head dim 80 runs zero-padded to 96 on this thread ...
/// drop(padded);
/// ```
#[must_use = "head dims are padded only while the guard lives"]
pub fn pad_head_dims() -> PaddedHeadDims {
    PADDED_HEAD_DIMS.with(|count| count.set(count.get() + 1));
    PaddedHeadDims {
        _thread: std::marker::PhantomData,
    }
}

/// Guard of [`pad_head_dims`]; it stays on the thread that made it.
pub struct PaddedHeadDims {
    _thread: std::marker::PhantomData<*const ()>,
}

impl Drop for PaddedHeadDims {
    fn drop(&mut self) {
        PADDED_HEAD_DIMS.with(|count| count.set(count.get() - 1));
    }
}

/// Whether a [`pad_head_dims`] guard lives on this thread.
///
/// # Example
///
/// ```
/// let padded = burn_flash::testing::pad_head_dims();
/// assert!(burn_flash::testing::head_dims_padded());
/// drop(padded);
/// assert!(!burn_flash::testing::head_dims_padded());
/// ```
pub fn head_dims_padded() -> bool {
    PADDED_HEAD_DIMS.with(|count| count.get() > 0)
}
