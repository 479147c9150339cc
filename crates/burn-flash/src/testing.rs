//! Hooks for tests; not part of the stable API.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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

static PORTABLE_ATOMIC_DQ: AtomicBool = AtomicBool::new(false);

/// Let the portable tile add dQ by f32 atomics too (process-wide; off by default). Per-unit
/// atomics make that path slower than the extra dQ launch on the runtimes the portable tile
/// serves, so it only runs when a test asks for it, to check on wgpu/lavapipe the atomic dQ's
/// indexing, which the tensor-core tile shares.
///
/// # Example
///
/// ```
/// burn_flash::testing::portable_atomic_dq(true);
/// // ... run a backward on wgpu ...
/// burn_flash::testing::portable_atomic_dq(false);
/// ```
pub fn portable_atomic_dq(enabled: bool) {
    PORTABLE_ATOMIC_DQ.store(enabled, Ordering::Relaxed);
}

/// Whether [`portable_atomic_dq`] is on; read by the backward launcher.
pub(crate) fn portable_atomic_dq_enabled() -> bool {
    PORTABLE_ATOMIC_DQ.load(Ordering::Relaxed)
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
