//! Launch of the backward: which inputs it takes, the grids, the gradient tensors.

use std::sync::OnceLock;

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::ir::features::AtomicUsage;
use cubecl::ir::{ElemType, FloatKind, Type};
use cubecl::prelude::*;

use super::key_value::key_value_grads;
use super::query::{finish_query_grads, query_grads};
use super::row_dot::row_dot;
use super::tail::{self, TailPlan, TailSplitLaunch, finish_tail};
use super::walk::{StridesLaunch, WalkDimsLaunch};
use crate::kernel::TilePath;
use crate::kernel::config::{MMA_M, ScoreParams, TailPart, TileConfig};
use crate::kernel::grid::{batch_inner, cube_count};
use crate::kernel::launch::{
    ScoreInputs, address_type, cube_dim, fill_tensor, fits_shared, flag_override, output,
    shape_override, stage_map, tma_staging, usable_tile, vector_width,
};
use crate::kernel::tile::{MmaTile, PortableTile};

/// Whether the fused backward can run inputs of this dtype and head dims on this client, and
/// with which tile (the same one the forward picks).
pub fn backward_support<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dtype: DType,
    head_dim: usize,
    value_dim: usize,
) -> Result<TilePath, String> {
    let tile = usable_tile(client, dtype, head_dim, value_dim)?;
    for cfg in [
        key_value_config(tile, head_dim, value_dim, false),
        query_config(tile, head_dim, value_dim),
    ] {
        fits_shared(client, "backward", cfg.backward_shared_bytes(dtype.size()))?;
    }
    Ok(tile)
}

/// Block shapes of the dK/dV launch; `atomic` when it also adds dQ by atomics. Each plane holds
/// two accumulators as wide as the head dim beside its two score-shaped tiles. Tensor cores at
/// head dim 128: pairs of planes share 32 owned keys (two m16 blocks) against 64-row stages of
/// queries, each plane computing the scores of 32 staged queries and holding half of the head
/// dim of dK and dV ([`TileConfig::split`]), so that every staged fragment feeds two products;
/// with atomics four pairs (128 keys per cube, half the atomics per product of a 64-key cube),
/// else two. Head dim 64 with atomics: the same four pairs, each plane holding half of the head
/// dim (32 columns, half a swizzle group), against 128-row stages (FlashAttention-2's block at
/// this head dim: each plane's scores then span 64 staged queries), with the owned keys and
/// values re-read from shared memory, as the scores take the registers that would hold them
/// ([`narrow_stages`] where the 202 KB of shared memory this needs do not fit). Other head
/// dims, and head dim 64 without atomics (where pairs measured no faster): 4 planes of 16 owned
/// keys (one m16 block) against 64-row stages.
/// `BURN_FLASH_BWD_SPLIT=1|2` and `BURN_FLASH_BWD_SHAPE=planes,rows,kv` override them for
/// tuning runs. Portable: 32 owned rows against 16-row stages, as the forward.
fn key_value_config(tile: TilePath, head_dim: usize, value_dim: usize, atomic: bool) -> TileConfig {
    static OVERRIDE: OnceLock<Option<(usize, usize, usize)>> = OnceLock::new();
    static SPLIT: OnceLock<Option<usize>> = OnceLock::new();
    let shape = OVERRIDE.get_or_init(|| shape_override("BURN_FLASH_BWD_SHAPE"));
    let split_override = SPLIT.get_or_init(|| {
        let text = std::env::var("BURN_FLASH_BWD_SPLIT").ok()?;
        let split = text
            .trim()
            .parse()
            .ok()
            .filter(|split| matches!(split, 1 | 2));
        if split.is_none() {
            log::warn!("ignoring BURN_FLASH_BWD_SPLIT={text:?}: expected 1 or 2");
        }
        split
    });
    let paired_64 = atomic && head_dim == 64 && value_dim == 64;
    let default_split = if head_dim.max(value_dim) == 128 || paired_64 {
        2
    } else {
        1
    };
    let split = split_override.unwrap_or(default_split);
    let paired_shape = match (atomic, paired_64) {
        (true, true) => (8, 32, 128),
        (true, false) => (8, 32, 64),
        (false, _) => (4, 32, 64),
    };
    let paired = tile_config(tile, head_dim, value_dim, shape.unwrap_or(paired_shape));
    if split > 1 && paired.can_split(split) {
        let paired = paired.with_split(split);
        if paired_64 && paired.block_kv > 64 {
            paired.with_owned_in_smem()
        } else {
            paired
        }
    } else {
        tile_config(tile, head_dim, value_dim, shape.unwrap_or((4, 16, 64)))
    }
}

/// The same single pass on 64-row stages with the owned operands in registers, for blocks of
/// 128-row stages that re-read them from shared memory ([`key_value_config`]): those need more
/// shared memory than an SM80 cube has.
fn narrow_stages(cfg: &TileConfig) -> Option<TileConfig> {
    (cfg.owned_in_smem && cfg.block_kv > 64).then_some(TileConfig {
        block_kv: 64,
        owned_in_smem: false,
        ..*cfg
    })
}

/// Block shapes of the dQ launch, which holds one head-dim-wide accumulator where the dK/dV
/// launch holds two, so each plane owns two m16 blocks of queries up to head dim 128 (every
/// staged K/V fragment then feeds two products): against 64-row key stages up to head dim 64,
/// 32-row ones above, where the scores of 64 keys would not fit beside the accumulator (measured
/// in `docs/perf-notes.md`). Head dim 256 keeps one m16 block per plane.
/// `BURN_FLASH_DQ_SHAPE=planes,rows,kv` overrides it for tuning runs.
fn query_config(tile: TilePath, head_dim: usize, value_dim: usize) -> TileConfig {
    static OVERRIDE: OnceLock<Option<(usize, usize, usize)>> = OnceLock::new();
    let shape = OVERRIDE.get_or_init(|| shape_override("BURN_FLASH_DQ_SHAPE"));
    let default = match head_dim.max(value_dim) {
        0..=64 => (4, 32, 64),
        65..=128 => (4, 32, 32),
        _ => (4, 16, 64),
    };
    tile_config(tile, head_dim, value_dim, shape.unwrap_or(default))
}

fn tile_config(
    tile: TilePath,
    head_dim: usize,
    value_dim: usize,
    (planes, plane_rows, block_kv): (usize, usize, usize),
) -> TileConfig {
    match tile {
        TilePath::TensorCore => {
            TileConfig::tensor_core(head_dim, value_dim, planes, plane_rows, block_kv)
        }
        TilePath::Portable => TileConfig::portable(head_dim, value_dim),
    }
}

/// Whether dQ can be added by f32 atomics from the dK/dV launch with these blocks: the runtime
/// adds f32 atomically, every plane gets whole m16 blocks of the staged queries, and the
/// transpose scratch fits in shared memory. Otherwise dQ takes its own launch.
fn atomic_dq_usable<R: CubeRuntime>(
    client: &ComputeClient<R>,
    cfg: &TileConfig,
    elem_size: usize,
) -> bool {
    let f32_atomic = Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32)));
    let adds = client
        .properties()
        .atomic_type_usage(f32_atomic)
        .contains(AtomicUsage::Add);
    let whole_blocks = match cfg.tile {
        TilePath::TensorCore => cfg.block_kv.is_multiple_of(cfg.planes / cfg.split * MMA_M),
        TilePath::Portable => true,
    };
    let atomic = cfg.with_atomic_dq(true);
    adds && whole_blocks
        && fits_shared(client, "backward", atomic.backward_shared_bytes(elem_size)).is_ok()
}

/// Whether the atomic dQ is the faster of the two ways for these shapes, as measured on the H100
/// (`docs/backward.md`): on the tensor-core tile from head dim 128 over at least 1024 keys, 2048
/// when causal (4–15 % faster there), and at head dim 64 over at least 2048 keys, 4096 when
/// causal (3–5 % from 4096 keys, 2.7 % at 2048; level with dQ's own launch at 2048 causal, 1–6 %
/// slower at 1024). Shorter and causal-short backwards and other head dims are faster with dQ's
/// own launch, and the portable tile's per-unit atomics always are.
/// [`force_atomic_dq`](crate::testing::force_atomic_dq) overrides this for tests, and
/// `BURN_FLASH_DQ_ATOMIC=0|1` for tuning runs.
fn atomic_dq_faster(cfg: &TileConfig, seq_k: usize) -> bool {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    let forced = OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_DQ_ATOMIC"));
    let d64 = cfg.head_dim == 64 && cfg.value_dim == 64;
    let min_keys = match (d64, cfg.mask.right) {
        (true, true) => 4096,
        (true, false) => 2048,
        (false, true) => 2048,
        (false, false) => 1024,
    };
    crate::testing::atomic_dq_forced()
        || forced.unwrap_or(
            cfg.tile == TilePath::TensorCore
                && (d64 || cfg.head_dim.max(cfg.value_dim) >= 128)
                && seq_k >= min_keys,
        )
}

/// Columns per atomic add of the dQ accumulator on the tensor-core tile: 4 where the runtime
/// adds `float4` atomically (CUDA on SM90+), else 1 (and always 1 on the portable tile, whose
/// units add single elements). `BURN_FLASH_DQ_VECTOR=1|2|4` picks the width for tuning runs
/// (1 runs the SM80 form on newer GPUs); a width the runtime cannot add falls back to 1.
fn dq_vector_width<R: CubeRuntime>(client: &ComputeClient<R>, cfg: &TileConfig) -> usize {
    static OVERRIDE: OnceLock<Option<usize>> = OnceLock::new();
    let wanted = OVERRIDE
        .get_or_init(|| {
            let text = std::env::var("BURN_FLASH_DQ_VECTOR").ok()?;
            let width = text.trim().parse().ok().filter(|w| matches!(w, 1 | 2 | 4));
            if width.is_none() {
                log::warn!("ignoring BURN_FLASH_DQ_VECTOR={text:?}: expected 1, 2 or 4");
            }
            width
        })
        .unwrap_or(4);
    let vector =
        Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32))).with_vector_size(wanted);
    let adds = client
        .properties()
        .atomic_type_usage(vector)
        .contains(AtomicUsage::Add);
    if cfg.tile == TilePath::TensorCore && adds {
        wanted
    } else {
        1
    }
}

/// How the dK/dV launch of `cfg` over `cubes` cubes of `steps` staged blocks each splits its
/// last wave ([`tail`]) on this client: the single pass on the tensor cores without a band, whose
/// cubes all walk the same blocks, one per SM (eight planes at more than 128 registers a unit:
/// ptxas gives them 252–255), over the GPU's SMs. `BURN_FLASH_TAIL_SPLIT=0` turns it off for
/// tuning runs; [`tail_slots`](crate::testing::tail_slots) forces a slot count on any dK/dV
/// launch (tests).
fn tail_plan<R: CubeRuntime>(
    client: &ComputeClient<R>,
    cfg: &TileConfig,
    cubes: usize,
    steps: usize,
) -> Option<TailPlan> {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    let hardware = &client.properties().hardware;
    let slots = match crate::testing::forced_tail_slots() {
        Some(slots) => slots,
        None => {
            let wanted = OVERRIDE
                .get_or_init(|| flag_override("BURN_FLASH_TAIL_SPLIT"))
                .unwrap_or(true);
            let uniform = !cfg.mask.left && !cfg.mask.right;
            if !(wanted && uniform && cfg.atomic_dq && cfg.tile == TilePath::TensorCore) {
                return None;
            }
            hardware.num_streaming_multiprocessors? as usize
        }
    };
    let (max_x, max_y, _) = hardware.max_cube_count;
    tail::plan(cubes, steps, slots)
        .filter(|plan| plan.pieces <= max_x as usize && plan.split <= max_y as usize)
}

/// The [`WalkDims`](super::walk::WalkDims) of a launch over queries `q` and keys `k` that
/// stages `first` and `second`, with statistics `stats` (`[b, h, seq_q]`).
fn walk_dims<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    first: &CubeTensor<R>,
    second: &CubeTensor<R>,
    stats: &CubeTensor<R>,
) -> WalkDimsLaunch<R> {
    let strides = |t: &CubeTensor<R>| {
        let s = t.meta.strides();
        StridesLaunch::new(s[0], s[1], s[2])
    };
    WalkDimsLaunch::new(
        q.meta.shape()[2],
        k.meta.shape()[2],
        q.meta.shape()[1],
        k.meta.shape()[1],
        strides(first),
        strides(second),
        strides(stats),
    )
}

/// The gradients of one backward: `bias` is the gradient of the scores, `[b, h, sq, sk]` in the
/// inputs' dtype, when it was asked for (the caller sums it over the bias's broadcast dims).
pub struct Grads<R: CubeRuntime> {
    pub q: CubeTensor<R>,
    pub k: CubeTensor<R>,
    pub v: CubeTensor<R>,
    pub bias: Option<CubeTensor<R>>,
}

/// Gradients of the fused attention, from its inputs, its output `out`, its log-sum-exp `lse`
/// (`[b, h, sq]`, f32) and the output gradient `d_out`. Inputs as for
/// [`forward`](crate::kernel::forward), accepted by [`backward_support`]. Unless
/// `deterministic`, dQ is summed by f32 atomics where that is faster ([`atomic_dq_faster`]),
/// [`atomic_dq_usable`] allows it and no bias gradient is asked for (`bias_grad`; it is written
/// by the dQ launch).
#[allow(clippy::too_many_arguments)]
pub fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    inputs: ScoreInputs<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_out: CubeTensor<R>,
    params: ScoreParams,
    deterministic: bool,
    bias_grad: bool,
) -> Grads<R> {
    let [q, k, v, out, lse, d_out] = [q, k, v, out, lse, d_out].map(into_contiguous);
    let params = params.with_inputs(inputs.mask_dims(), inputs.bias.is_some());
    let bias_grad = bias_grad && inputs.bias.is_some();
    let dims = q.meta.shape().clone();
    let (batch, heads, seq_q, head_dim) = (dims[0], dims[1], dims[2], dims[3]);
    let (kv_heads, seq_k, value_dim) = (k.meta.shape()[1], k.meta.shape()[2], v.meta.shape()[3]);
    let client = q.client.clone();
    let dtype = q.dtype;

    let d_q = output(&q, Shape::new([batch, heads, seq_q, head_dim]), dtype);
    let d_k = output(&q, Shape::new([batch, kv_heads, seq_k, head_dim]), dtype);
    let d_v = output(&q, Shape::new([batch, kv_heads, seq_k, value_dim]), dtype);
    let delta = output(&q, Shape::new([batch, heads, seq_q]), DType::F32);
    let d_bias = bias_grad.then(|| {
        let d_bias = output(&q, Shape::new([batch, heads, seq_q, seq_k]), dtype);
        // The dQ launch writes the pairs of the blocks it visits; a band skips some.
        if params.mask.left || params.mask.right {
            fill_tensor(&d_bias, 0.0);
        }
        d_bias
    });
    let grads = Grads {
        q: d_q.clone(),
        k: d_k.clone(),
        v: d_v.clone(),
        bias: d_bias.clone(),
    };
    if batch * heads == 0 {
        return grads;
    }
    let tile = backward_support(&client, dtype, head_dim, value_dim)
        .unwrap_or_else(|reason| panic!("fused backward launched on unsupported input: {reason}"));
    let batch_inner = batch_inner(&inputs, batch);
    let blocks = |atomic| {
        key_value_config(tile, head_dim, value_dim, atomic)
            .with_scores(&params)
            .with_bias_grad(bias_grad)
            .with_batch_inner(batch_inner)
    };
    let query_cfg = query_config(tile, head_dim, value_dim)
        .with_scores(&params)
        .with_bias_grad(bias_grad)
        .with_batch_inner(batch_inner);
    let atomic = (!deterministic && !bias_grad && seq_q > 0)
        .then(|| blocks(true))
        .filter(|atomic| atomic_dq_faster(atomic, seq_k))
        .and_then(|atomic| {
            [Some(atomic), narrow_stages(&atomic)]
                .into_iter()
                .flatten()
                .find(|atomic| atomic_dq_usable(&client, atomic, dtype.size()))
        });
    let cfg = match atomic {
        Some(atomic) => atomic.with_atomic_dq(true),
        None => blocks(false),
    };
    let backward_bytes = |cfg: &TileConfig| cfg.backward_shared_bytes(dtype.size());
    let cfg = if tma_staging(&client, &cfg, &[&q, &d_out], backward_bytes) {
        crate::testing::record_tma_launch();
        cfg.with_tma()
    } else {
        cfg
    };
    crate::testing::record_dq_launch(cfg.atomic_dq);
    let key_blocks = seq_k.div_ceil(cfg.block_q);
    let query_steps = heads / kv_heads * seq_q.div_ceil(cfg.block_kv);
    let tail = tail_plan(&client, &cfg, batch * kv_heads * key_blocks, query_steps);
    if tail.is_some() {
        crate::testing::record_tail_split();
    }
    // The split cubes' partial dK/dV sums, each piece's rows whole (see `tail`).
    let partials = tail.map(|plan| {
        output(
            &q,
            Shape::new([plan.split * plan.pieces, cfg.block_q, head_dim + value_dim]),
            DType::F32,
        )
    });
    // The dK/dV launches: the whole grid, or its whole cubes and then the pieces.
    let key_value_parts = match tail {
        _ if seq_k == 0 => Vec::new(),
        None => vec![(cube_count(&cfg, seq_k, kv_heads, batch), cfg, None)],
        Some(plan) => [
            (plan.whole > 0).then(|| {
                let grid = cube_count(&cfg, seq_k, kv_heads, batch);
                (grid, cfg.with_tail(TailPart::Whole), None)
            }),
            Some((
                CubeCount::Static(plan.pieces as u32, plan.split as u32, 1),
                cfg.with_tail(TailPart::Pieces),
                partials.clone(),
            )),
        ]
        .into_iter()
        .flatten()
        .collect(),
    };
    let grid_rows = if cfg.batch_inner { batch } else { kv_heads };
    let (whole, pieces) = tail.map_or((0, 1), |plan| (plan.whole, plan.pieces));
    let tail_split = || {
        TailSplitLaunch::new(
            whole as u32,
            pieces as u32,
            key_blocks as u32,
            grid_rows as u32,
        )
    };
    // The atomic dQ's f32 accumulator, contiguous and zeroed (see `key_value`).
    let accum = cfg.atomic_dq.then(|| {
        let accum = empty_device_contiguous_dtype(
            client.clone(),
            q.device.clone(),
            Shape::new([batch, heads, seq_q, head_dim]),
            DType::F32,
        );
        fill_tensor(&accum, 0.0);
        accum
    });
    // The score inputs and the bias gradient (`[b, h, sq, sk]`) can be the largest tensors.
    let address = address_type(&[&q, &k, &v, &out, &d_out, &d_q, &d_k, &d_v])
        .max(inputs.address_type())
        .max(address_type(&d_bias.iter().collect::<Vec<_>>()));
    let dq_width = dq_vector_width(&client, &cfg);
    let elem: StorageType = dtype.into();
    let dtypes = [elem, inputs.mask_dtype()];
    let softcap = params.softcap.unwrap_or(1.0);
    let (seed_lo, seed_hi, threshold) = params.dropout_args();
    let alibi_pow2 = params.alibi_pow2.unwrap_or(1);
    let query_dims = walk_dims(&q, &k, &k, &v, &lse);

    // SAFETY: shapes and strides were validated by the caller; every index the kernels form is
    // bounded by the tensors' shapes (rows past the ends are clamped, zero-filled or skipped).
    unsafe {
        let rows = batch * heads * seq_q;
        if rows > 0 {
            let width = vector_width(&[&out, &d_out]);
            let vectors = value_dim / width;
            // Planes of 32 lanes on the tensor-core tile's devices; the portable path keeps a
            // unit per row (no plane operations).
            let group = match tile {
                TilePath::TensorCore => vectors.next_power_of_two().min(32),
                TilePath::Portable => 1,
            };
            let units = rows * group;
            // Whole planes per cube, so that no group straddles two cubes.
            let cube_dim = CubeDim::new_1d(256);
            row_dot::launch_unchecked(
                &client,
                cubecl::calculate_cube_count_elemwise(&client, units, cube_dim),
                cube_dim,
                address,
                width,
                out.into_tensor_arg(),
                d_out.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                vectors,
                group,
                elem,
            );
        }
        macro_rules! launch_grads {
            ($tile:ty) => {{
                for (grid, part_cfg, part_partials) in key_value_parts.iter().cloned() {
                    key_value_grads::launch_unchecked::<$tile, R>(
                        &client,
                        grid,
                        cube_dim(&cfg),
                        address,
                        dq_width,
                        q.clone().into_tensor_arg(),
                        k.clone().into_tensor_arg(),
                        v.clone().into_tensor_arg(),
                        inputs.mask_arg().into(),
                        inputs.bias_arg().into(),
                        d_out.clone().into_tensor_arg(),
                        stage_map(&q, &cfg).into(),
                        stage_map(&d_out, &cfg).into(),
                        lse.clone().into_tensor_arg(),
                        delta.clone().into_tensor_arg(),
                        d_k.clone().into_tensor_arg(),
                        d_v.clone().into_tensor_arg(),
                        match &accum {
                            Some(accum) => {
                                ComptimeOptionArgs::Some(accum.clone().into_tensor_arg())
                            }
                            None => ComptimeOptionArgs::None,
                        },
                        match part_partials {
                            Some(partials) => ComptimeOptionArgs::Some(partials.into_tensor_arg()),
                            None => ComptimeOptionArgs::None,
                        },
                        walk_dims(&q, &k, &q, &d_out, &lse),
                        tail_split(),
                        params.scale,
                        params.left,
                        params.right,
                        softcap,
                        seed_lo,
                        seed_hi,
                        threshold,
                        alibi_pow2,
                        part_cfg,
                        dtypes,
                    );
                }
                if let Some(partials) = partials {
                    let units = partials.meta.num_elements() / pieces;
                    let cube_dim = CubeDim::new(&client, units);
                    finish_tail::launch_unchecked(
                        &client,
                        cubecl::calculate_cube_count_elemwise(&client, units, cube_dim),
                        cube_dim,
                        address,
                        partials.into_tensor_arg(),
                        d_k.clone().into_tensor_arg(),
                        d_v.clone().into_tensor_arg(),
                        tail_split(),
                        seq_k,
                        params.scale,
                        cfg,
                        elem,
                    );
                }
                if let Some(accum) = &accum {
                    let width = vector_width(&[accum, &d_q]);
                    let units = batch * heads * seq_q * head_dim / width;
                    let cube_dim = CubeDim::new(&client, units);
                    finish_query_grads::launch_unchecked(
                        &client,
                        cubecl::calculate_cube_count_elemwise(&client, units, cube_dim),
                        cube_dim,
                        address,
                        width,
                        accum.clone().into_tensor_arg(),
                        d_q.clone().into_tensor_arg(),
                        params.scale,
                        elem,
                    );
                } else if seq_q > 0 {
                    query_grads::launch_unchecked::<$tile, R>(
                        &client,
                        cube_count(&query_cfg, seq_q, heads, batch),
                        cube_dim(&query_cfg),
                        address,
                        q.into_tensor_arg(),
                        k.into_tensor_arg(),
                        v.into_tensor_arg(),
                        inputs.mask_arg().into(),
                        inputs.bias_arg().into(),
                        d_out.into_tensor_arg(),
                        lse.into_tensor_arg(),
                        delta.into_tensor_arg(),
                        d_q.clone().into_tensor_arg(),
                        d_bias.clone().map(CubeTensor::into_tensor_arg).into(),
                        query_dims,
                        params.scale,
                        params.left,
                        params.right,
                        softcap,
                        seed_lo,
                        seed_hi,
                        threshold,
                        alibi_pow2,
                        query_cfg,
                        dtypes,
                    );
                }
            }};
        }
        match tile {
            TilePath::TensorCore => {
                launch_grads!(MmaTile);
            }
            TilePath::Portable => {
                launch_grads!(PortableTile);
            }
        }
    }
    grads
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::config::MaskConfig;

    #[test]
    fn atomic_dq_only_where_measured_faster() {
        let tc = |d: usize, causal: bool| TileConfig {
            mask: MaskConfig {
                right: causal,
                ..MaskConfig::default()
            },
            ..key_value_config(TilePath::TensorCore, d, d, true)
        };
        assert!(atomic_dq_faster(&tc(128, false), 1024));
        assert!(!atomic_dq_faster(&tc(128, false), 1023));
        assert!(atomic_dq_faster(&tc(128, true), 2048));
        assert!(!atomic_dq_faster(&tc(128, true), 1024));
        assert!(atomic_dq_faster(&tc(256, false), 4096));
        assert!(atomic_dq_faster(&tc(64, false), 4096));
        assert!(atomic_dq_faster(&tc(64, true), 16384));
        assert!(atomic_dq_faster(&tc(64, false), 2048));
        assert!(!atomic_dq_faster(&tc(64, false), 2047));
        assert!(!atomic_dq_faster(&tc(64, true), 4095));
        assert!(!atomic_dq_faster(&tc(32, false), 16384));
        assert!(!atomic_dq_faster(&tc(96, false), 16384));
        // Head dim 64 takes the atomic dQ in split pairs of 128 keys, without it unsplit.
        assert_eq!(
            key_value_config(TilePath::TensorCore, 64, 64, true).split,
            2
        );
        assert_eq!(
            key_value_config(TilePath::TensorCore, 64, 64, false).split,
            1
        );
        let portable = key_value_config(TilePath::Portable, 128, 128, true);
        assert!(!atomic_dq_faster(&portable, 16384));
        let _forced = crate::testing::force_atomic_dq();
        assert!(atomic_dq_faster(&tc(64, true), 1));
        assert!(atomic_dq_faster(&portable, 1));
    }

    #[test]
    fn head_dim_64_single_pass_narrows_where_shared_memory_is_short() {
        let wide = key_value_config(TilePath::TensorCore, 64, 64, true).with_atomic_dq(true);
        assert_eq!((wide.block_q, wide.block_kv, wide.split), (128, 128, 2));
        assert!(wide.query_in_smem() && wide.with_widths(64, 64).query_in_smem());
        // 227 KiB per cube on SM90, 163 KiB on SM80.
        let bytes = wide.backward_shared_bytes(2);
        assert!(bytes <= 227 * 1024 && bytes > 163 * 1024, "{bytes}");
        let narrow = narrow_stages(&wide).expect("a narrower shape");
        assert_eq!(
            (narrow.block_q, narrow.block_kv, narrow.split),
            (128, 64, 2)
        );
        assert!(!narrow.query_in_smem() && !narrow.with_widths(64, 64).query_in_smem());
        assert!(narrow.backward_shared_bytes(2) <= 163 * 1024);
        assert_eq!(narrow_stages(&narrow), None);
        // Head dim 128 stages 64 rows already.
        let d128 = key_value_config(TilePath::TensorCore, 128, 128, true);
        assert_eq!((d128.block_kv, narrow_stages(&d128)), (64, None));
    }
}
