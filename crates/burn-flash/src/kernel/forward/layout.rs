//! The forward's shapes and strides, passed to its launch as scalars. CubeCL reads a tensor's
//! `shape` and `stride` from a metadata buffer in global memory: a cube that formed its first
//! addresses from them waited for that buffer's round trip (from DRAM, once other work has
//! evicted it) before its first copy could issue. Scalars sit in the launch's constant bank.

use cubecl::prelude::*;

use crate::kernel::tensors::KernelTensor;

/// One tensor's strides over its first three dims.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Strides {
    /// Between batches (or a paged cache's pages).
    pub outer: usize,
    /// Between heads.
    pub head: usize,
    /// Between rows.
    pub row: usize,
}

/// The dims and strides the forward addresses its tensors by.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Layout {
    /// Query heads (`q.shape(1)`).
    pub heads: usize,
    /// Key/value heads (`k.shape(1)`).
    pub kv_heads: usize,
    /// Query rows (`q.shape(2)`).
    pub seq_q: usize,
    /// Key rows of one sequence, or of one page (`k.shape(2)`).
    pub key_rows: usize,
    /// Splits of the keys (`out.shape(1) / q.shape(1)`; 1 unsplit).
    pub splits: usize,
    pub q: Strides,
    pub k: Strides,
    pub v: Strides,
    pub out: Strides,
    pub lse: Strides,
    /// A paged cache's dims (unused without a block table).
    pub pages: PageDims,
}

/// A layout of ones, for a kernel created without tensors: scalars are not part of its source.
pub fn placeholder() -> LayoutLaunch {
    let ones = || StridesLaunch::new(1, 1, 1);
    LayoutLaunch::new(
        1,
        1,
        1,
        1,
        1,
        ones(),
        ones(),
        ones(),
        ones(),
        ones(),
        PageDimsLaunch::new(1, 1, 1),
    )
}

/// `tensor`'s strides over its first three dims, as launch scalars.
fn strides(tensor: &KernelTensor) -> StridesLaunch {
    let strides = tensor.meta.strides();
    StridesLaunch::new(strides[0], strides[1], strides[2])
}

/// The layout of a launch over these tensors (`out` and `lse` hold a head per (split, query
/// head); with a block table, K and V are `[pages, kv_heads, page_size, dim]` and each
/// sequence has `pages_per_sequence` entries, 1 without). Keys and values staged by tensor
/// maps (`kv_by_maps`) are addressed by coordinates, never by strides: theirs are passed as
/// zeros, since a cache of more than `u32::MAX` elements keeps a 32-bit kernel, whose scalars
/// they would not fit.
pub fn layout(
    q: &KernelTensor,
    k: &KernelTensor,
    v: &KernelTensor,
    out: &KernelTensor,
    lse: &KernelTensor,
    pages_per_sequence: usize,
    kv_by_maps: bool,
) -> LayoutLaunch {
    let (q_dims, k_dims) = (q.meta.shape(), k.meta.shape());
    let kv_strides = |tensor| {
        if kv_by_maps {
            StridesLaunch::new(0, 0, 0)
        } else {
            strides(tensor)
        }
    };
    LayoutLaunch::new(
        q_dims[1],
        k_dims[1],
        q_dims[2],
        k_dims[2],
        out.meta.shape()[1] / q_dims[1],
        strides(q),
        kv_strides(k),
        kv_strides(v),
        strides(out),
        strides(lse),
        PageDimsLaunch::new(k_dims[2], k_dims[0], pages_per_sequence),
    )
}

/// A paged cache's dims (unused without a block table). Read from the metadata buffer, a
/// block's page waited for two loads in turn (the dims, then the table).
#[derive(CubeLaunch, CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct PageDims {
    /// Keys a page holds (`k.shape(2)` of the paged K and V).
    pub rows: usize,
    /// Pages in the cache (`k.shape(0)`).
    pub count: usize,
    /// Table entries per sequence: the table's row stride (it is contiguous).
    pub per_sequence: usize,
}
