//! Hooks for tests; not part of the stable API.

use std::sync::atomic::{AtomicBool, Ordering};

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
