//! How a backward runs, decided on the host from the device's features ([`DeviceCaps`]) and the
//! problem: the tile, the block shapes of the dK/dV and dQ launches, how dQ is summed (by f32
//! atomics from the dK/dV launch, or by its own launch, and why), whether Q and dO arrive by
//! tensor maps, and whether the dK/dV launch's last wave is split ([`tail`](super::tail)).
//! [`launch`](super::launch) allocates and enqueues what the plan says.

use std::fmt;
use std::sync::OnceLock;

use cubecl::ir::ElemType;

use super::tail::{self, TailPlan};
use crate::kernel::config::{MMA_M, ScoreParams, TileConfig, TilePath, WarpgroupBackwardConfig};
use crate::kernel::device::DeviceCaps;
use crate::kernel::forward::plan::tma_staging;
use crate::kernel::grid::batch_inner;
use crate::kernel::tuning::{choice_override, flag_override, shape_override};

/// What the backward plan is decided on, beside the device.
#[derive(Clone, Copy, Debug)]
pub struct BackwardProblem {
    pub dtype: ElemType,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    /// The score parameters, with the inputs' ([`ScoreParams::with_inputs`]).
    pub params: ScoreParams,
    /// The batch size of the bias input, if there is one.
    pub bias_batch: Option<usize>,
    /// The caller asked for the same bits on every run.
    pub deterministic: bool,
    /// The bias gradient is asked for (and there is a bias).
    pub bias_grad: bool,
    /// Q and dO can be read through tensor maps ([`tma_aligned`](crate::kernel::tensors::tma_aligned)).
    pub staged_tma_aligned: bool,
    /// K and V can be read through tensor maps.
    pub kv_tma_aligned: bool,
    /// Sequences are packed along the rows ([`TileConfig::varlen`]): `batch` counts them,
    /// `seq_q` and `seq_k` are the longest one's.
    pub varlen: bool,
}

/// How dQ is summed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DqMode {
    /// By f32 atomics from the dK/dV launch, as FlashAttention-2 does: one pass over the
    /// scores, a summation order that varies between runs.
    Atomic,
    /// By its own launch over query blocks, which recomputes the scores.
    Launch(DqLaunchReason),
}

/// Why dQ takes its own launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DqLaunchReason {
    /// The caller asked for a deterministic backward (the default).
    Deterministic,
    /// The sequences are packed: the atomic accumulator's rows are not placed per sequence.
    Packed,
    /// The dQ launch also writes the bias gradient.
    BiasGrad,
    /// There are no queries.
    NoQueries,
    /// Its own launch measured faster at these shapes ([`atomic_dq_faster`]).
    Faster,
    /// The device cannot run the atomic dQ's blocks ([`atomic_dq_usable`]).
    Unsupported,
}

/// A backward, as planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardPlan {
    /// The dK/dV launch's blocks (with `atomic_dq` and `tma` as planned).
    pub key_value: TileConfig,
    /// The dQ launch's blocks (unused with the atomic dQ).
    pub query: TileConfig,
    pub dq: DqMode,
    /// Columns per atomic add of the dQ accumulator.
    pub dq_width: usize,
    /// The split of the dK/dV launch's last wave, if any.
    pub tail: Option<TailPlan>,
    /// The backward on Hopper's warpgroup products runs instead of the dK/dV launch
    /// ([`warpgroup`](super::warpgroup), [`warpgroup_blocks`]); dQ by its atomics or, with
    /// the deterministic dQ, by the dQ launch.
    pub warpgroup: Option<WarpgroupBackwardConfig>,
}

/// Whether the fused backward can run inputs of this dtype and head dims on this device, and
/// with which tile (the same one the forward picks).
pub fn support(
    caps: &DeviceCaps,
    dtype: ElemType,
    head_dim: usize,
    value_dim: usize,
) -> Result<TilePath, String> {
    let tile = caps.tile(dtype, head_dim, value_dim)?;
    for cfg in [
        key_value_config(tile, head_dim, value_dim, false),
        query_config(tile, head_dim, value_dim),
    ] {
        caps.fits_shared("backward", cfg.backward_shared_bytes(dtype.size()))?;
    }
    Ok(tile)
}

impl BackwardPlan {
    /// The plan of `problem` on `caps`; `Err` where [`support`] refuses it.
    pub fn new(caps: &DeviceCaps, problem: &BackwardProblem) -> Result<Self, String> {
        let p = *problem;
        let tile = support(caps, p.dtype, p.head_dim, p.value_dim)?;
        let batch_inner = batch_inner(p.bias_batch, p.batch);
        let blocks = |atomic| {
            key_value_config(tile, p.head_dim, p.value_dim, atomic)
                .with_scores(&p.params)
                .with_bias_grad(p.bias_grad)
                .with_batch_inner(batch_inner)
        };
        let query = query_config(tile, p.head_dim, p.value_dim)
            .with_scores(&p.params)
            .with_bias_grad(p.bias_grad)
            .with_batch_inner(batch_inner);
        let atomic = || {
            let atomic = blocks(true);
            if !atomic_dq_faster(&atomic, p.seq_k) {
                return Err(DqLaunchReason::Faster);
            }
            [Some(atomic), narrow_stages(&atomic)]
                .into_iter()
                .flatten()
                .find(|atomic| atomic_dq_usable(caps, atomic, p.dtype.size()))
                .ok_or(DqLaunchReason::Unsupported)
        };
        let atomic = if p.varlen {
            Err(DqLaunchReason::Packed)
        } else if p.deterministic {
            Err(DqLaunchReason::Deterministic)
        } else if p.bias_grad {
            Err(DqLaunchReason::BiasGrad)
        } else if p.seq_q == 0 {
            Err(DqLaunchReason::NoQueries)
        } else {
            atomic()
        };
        let (cfg, dq) = match atomic {
            Ok(atomic) => (atomic.with_atomic_dq(true), DqMode::Atomic),
            Err(reason) => (blocks(false), DqMode::Launch(reason)),
        };
        let backward_bytes = |cfg: &TileConfig| cfg.backward_shared_bytes(p.dtype.size());
        // Packed sequences stage Q and dO by 16-byte copies, which zero the rows past a
        // sequence's end (a tensor map's box would read the next sequence's), and take no split
        // tail (its pieces are not placed per sequence).
        let cfg = if !p.varlen && tma_staging(caps, &cfg, p.staged_tma_aligned, backward_bytes) {
            cfg.with_tma()
        } else {
            cfg
        };
        let key_blocks = p.seq_k.div_ceil(cfg.block_q);
        let query_steps = p.heads / p.kv_heads.max(1) * p.seq_q.div_ceil(cfg.block_kv);
        let tail = if p.varlen {
            None
        } else {
            tail_plan(caps, &cfg, p.batch * p.kv_heads * key_blocks, query_steps)
        };
        let (cfg, query) = if p.varlen {
            (cfg.with_varlen(), query.with_varlen())
        } else {
            (cfg, query)
        };
        let wanted = crate::testing::warpgroup_backward_forced()
            || (!crate::testing::warpgroup_backward_avoided()
                && warpgroup_override().unwrap_or_else(|| warpgroup_pays(&cfg, &p)));
        let warpgroup =
            warpgroup_blocks(caps, &cfg, &p).filter(|_| cfg!(feature = "cuda") && wanted);
        Ok(Self {
            key_value: cfg,
            query,
            dq,
            dq_width: dq_vector_width(caps, &cfg),
            tail: tail.filter(|_| warpgroup.is_none()),
            warpgroup,
        })
    }
}

/// Whether the Hopper backward leads the tensor-core tile's dK/dV launch, where it can run: at
/// head dim 128, with the atomic dQ everywhere the plan takes that (its training step measured
/// 1.00–1.10× the tile's, plain and causal, n 2048–16384), with the deterministic dQ where the
/// keys walked (half of them under a causal mask) are 2048 or more (1.01–1.06× the tile's
/// step there; 0.91–0.97× below). At head dim 64, 0.81–0.93× the tile's step either way. H200,
/// 2026-11-30 (`docs/hopper.md`).
fn warpgroup_pays(cfg: &TileConfig, p: &BackwardProblem) -> bool {
    let walked = if p.params.mask.right {
        p.seq_k / 2
    } else {
        p.seq_k
    };
    p.head_dim == 128 && (cfg.atomic_dq || walked >= 2048)
}

/// `BURN_FLASH_WARPGROUP_BACKWARD=1`: the Hopper backward wherever it can run (head dim 64
/// too); `=0`: the tensor-core tile's everywhere (the SM80 path). Unset: where
/// [`warpgroup_pays`].
fn warpgroup_override() -> Option<bool> {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_WARPGROUP_BACKWARD"))
}

/// The Hopper backward's blocks ([`warpgroup`](super::warpgroup)) where it can run the
/// problem, dQ by its atomics where the plan adds dQ so (`cfg.atomic_dq`), else by the
/// tensor-core tile's dQ launch after it: on a device with warpgroup products (SM90:
/// [`DeviceCaps::wgmma`]), head dim 64 or 128 for queries and values alike, plain or causal
/// attention over whole batches of keys (no mask or bias input, window's left side, softcap,
/// dropout or ALiBi), every input readable by tensor maps. Not where a test asks for the
/// tile's staging by copies ([`avoid_tma`](crate::testing::avoid_tma)) or for its dK/dV
/// launch's tail split ([`tail_slots`](crate::testing::tail_slots)).
fn warpgroup_blocks(
    caps: &DeviceCaps,
    cfg: &TileConfig,
    p: &BackwardProblem,
) -> Option<WarpgroupBackwardConfig> {
    let params = &p.params;
    let blocks = WarpgroupBackwardConfig {
        head_dim: p.head_dim,
        causal: params.mask.right,
        bf16: p.dtype == crate::kernel::tensors::BF16,
        atomic_dq: cfg.atomic_dq,
    };
    let runs = caps.wgmma
        && cfg.tile == TilePath::TensorCore
        && matches!(p.head_dim, 64 | 128)
        && p.value_dim == p.head_dim
        && params.plain_or_causal()
        && !p.varlen
        && p.staged_tma_aligned
        && p.kv_tma_aligned
        && !crate::testing::tma_avoided()
        && crate::testing::forced_tail_slots().is_none()
        && caps.fits_shared("backward", blocks.shared_bytes()).is_ok();
    runs.then_some(blocks)
}

impl fmt::Display for BackwardPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cfg = &self.key_value;
        if let Some(warpgroup) = &self.warpgroup {
            write!(
                f,
                "warpgroup dK/dV (wgmma): {} keys × {}-row stages, {} warpgroups, Q, K, V and \
                 dO by tensor maps{}",
                warpgroup.block_k(),
                WarpgroupBackwardConfig::BLOCK_Q,
                WarpgroupBackwardConfig::WARPGROUPS,
                if warpgroup.causal { ", causal" } else { "" }
            )?;
        } else {
            write!(
                f,
                "dK/dV: {} keys × {}-row stages, {} planes",
                cfg.block_q, cfg.block_kv, cfg.planes
            )?;
            if cfg.tma {
                write!(f, " (tensor maps)")?;
            }
        }
        match self.dq {
            DqMode::Atomic if self.warpgroup.is_some() => {
                write!(f, "; dQ by atomics, 4 columns per add")?
            }
            DqMode::Atomic => write!(f, "; dQ by atomics, {} columns per add", self.dq_width)?,
            DqMode::Launch(reason) => write!(
                f,
                "; dQ launch {} queries × {}-key stages ({reason:?})",
                self.query.block_q, self.query.block_kv
            )?,
        }
        if let Some(tail) = self.tail {
            write!(f, "; last {} cubes in {} pieces", tail.split, tail.pieces)?;
        }
        Ok(())
    }
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
    let split_override = SPLIT.get_or_init(|| choice_override("BURN_FLASH_BWD_SPLIT", &[1, 2]));
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
fn atomic_dq_usable(caps: &DeviceCaps, cfg: &TileConfig, elem_size: usize) -> bool {
    let adds = caps.adds_f32(1);
    let whole_blocks = match cfg.tile {
        TilePath::TensorCore => cfg.block_kv.is_multiple_of(cfg.planes / cfg.split * MMA_M),
        TilePath::Portable => true,
    };
    let atomic = cfg.with_atomic_dq(true);
    adds && whole_blocks
        && caps
            .fits_shared("backward", atomic.backward_shared_bytes(elem_size))
            .is_ok()
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
fn dq_vector_width(caps: &DeviceCaps, cfg: &TileConfig) -> usize {
    static OVERRIDE: OnceLock<Option<usize>> = OnceLock::new();
    let wanted = OVERRIDE
        .get_or_init(|| choice_override("BURN_FLASH_DQ_VECTOR", &[1, 2, 4]))
        .unwrap_or(4);
    if cfg.tile == TilePath::TensorCore && caps.adds_f32(wanted) {
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
fn tail_plan(caps: &DeviceCaps, cfg: &TileConfig, cubes: usize, steps: usize) -> Option<TailPlan> {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
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
            caps.sms?
        }
    };
    let (max_x, max_y, _) = caps.max_cube_count;
    tail::plan(cubes, steps, slots)
        .filter(|plan| plan.pieces <= max_x as usize && plan.split <= max_y as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::config::MaskConfig;
    use crate::kernel::device::caps;

    /// Held by the tests that read the process-wide [`force_atomic_dq`] state, one of which
    /// forces it.
    ///
    /// [`force_atomic_dq`]: crate::testing::force_atomic_dq
    static FORCING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn atomic_dq_only_where_measured_faster() {
        let _serial = FORCING.lock().unwrap_or_else(|e| e.into_inner());
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

    fn problem(d: usize, n: usize, deterministic: bool) -> BackwardProblem {
        let options = crate::options::FlashAttentionOptions::new();
        BackwardProblem {
            dtype: crate::kernel::tensors::BF16,
            batch: 16384 / n,
            heads: 2048 / d,
            kv_heads: 2048 / d,
            seq_q: n,
            seq_k: n,
            head_dim: d,
            value_dim: d,
            params: ScoreParams::new(&options, 2048 / d, d, n, n),
            bias_batch: None,
            deterministic,
            bias_grad: false,
            staged_tma_aligned: true,
            kv_tma_aligned: true,
            varlen: false,
        }
    }

    #[test]
    fn plans_say_how_dq_is_summed_and_why() {
        let _serial = FORCING.lock().unwrap_or_else(|e| e.into_inner());
        let h100 = caps::h100();
        let plan = BackwardPlan::new(&h100, &problem(64, 4096, false)).unwrap();
        assert_eq!(plan.dq, DqMode::Atomic);
        assert_eq!(plan.dq_width, 4, "float4 atomics on SM90");
        assert!(plan.key_value.atomic_dq && plan.key_value.tma);
        // FlashAttention-2's d 64 shapes: 4096 cubes of 128 keys, 31 waves of 132 SMs and 4
        // cubes, which the tail split spreads over the idle SMs.
        assert_eq!(
            plan.tail,
            Some(TailPlan {
                whole: 4092,
                split: 4,
                pieces: 32
            })
        );
        let det = BackwardPlan::new(&h100, &problem(64, 4096, true)).unwrap();
        assert_eq!(det.dq, DqMode::Launch(DqLaunchReason::Deterministic));
        assert!(!det.key_value.atomic_dq && det.tail.is_none());
        let short = BackwardPlan::new(&h100, &problem(64, 1024, false)).unwrap();
        assert_eq!(short.dq, DqMode::Launch(DqLaunchReason::Faster));
        // SM80: 163 KiB per cube takes the d 64 single pass on 64-row stages; no tensor maps,
        // one column per atomic add.
        let a100 = BackwardPlan::new(&caps::a100(), &problem(64, 4096, false)).unwrap();
        assert_eq!(a100.dq, DqMode::Atomic);
        assert_eq!((a100.key_value.block_kv, a100.dq_width), (64, 1));
        assert!(!a100.key_value.tma);
        // The portable tile sums dQ by its own launch, which measured faster.
        let portable = BackwardPlan::new(&caps::lavapipe(), &problem(64, 4096, false)).unwrap();
        assert_eq!(portable.key_value.tile, TilePath::Portable);
        assert_eq!(portable.dq, DqMode::Launch(DqLaunchReason::Faster));
        assert!(plan.to_string().contains("dQ by atomics"), "{plan}");
    }

    #[test]
    fn warpgroup_backward_at_head_dim_128_or_where_asked_for_and_it_runs() {
        let _serial = FORCING.lock().unwrap_or_else(|e| e.into_inner());
        let h100 = caps::h100();
        let plan = |caps: &DeviceCaps, d, deterministic| {
            BackwardPlan::new(caps, &problem(d, 4096, deterministic)).unwrap()
        };
        if !cfg!(feature = "cuda") {
            // Without the CUDA path there is no kernel to plan.
            let _hopper = crate::testing::force_warpgroup_backward();
            assert_eq!(plan(&h100, 128, false).warpgroup, None);
            return;
        }
        // The default at head dim 128 (docs/hopper.md: faster than the tile's backward there),
        // not at 64 unless asked for.
        if warpgroup_override().is_none() {
            assert!(plan(&h100, 128, false).warpgroup.is_some());
            assert_eq!(plan(&h100, 64, false).warpgroup, None);
            // The deterministic dQ's from 2048 keys walked.
            assert!(plan(&h100, 128, true).warpgroup.is_some());
            let short = BackwardPlan::new(&h100, &problem(128, 1024, true)).unwrap();
            assert_eq!(short.warpgroup, None);
            let tile = crate::testing::avoid_warpgroup_backward();
            assert_eq!(plan(&h100, 128, false).warpgroup, None);
            drop(tile);
        }
        let _hopper = crate::testing::force_warpgroup_backward();
        for d in [64, 128] {
            let hopper = plan(&h100, d, false);
            let blocks = hopper.warpgroup.expect("the atomic dQ on SM90");
            assert_eq!(
                (blocks.head_dim, blocks.block_k(), blocks.atomic_dq),
                (d, 128, true)
            );
            // Two buffers of dSᵀ besides the owned keys and values and three stages: 197 KB at
            // head dim 128 (CubeCL's own count for the kernel: 196664 bytes).
            assert!(
                blocks.shared_bytes() <= 227 * 1024,
                "{}",
                blocks.shared_bytes()
            );
            assert!(hopper.tail.is_none() && hopper.to_string().contains("wgmma"));
        }
        // The deterministic dQ: dK and dV on it, dQ by the tile's launch after it.
        let deterministic = plan(&h100, 128, true);
        let blocks = deterministic
            .warpgroup
            .expect("the deterministic dQ on SM90");
        assert!(!blocks.atomic_dq);
        assert_eq!(
            deterministic.dq,
            DqMode::Launch(DqLaunchReason::Deterministic)
        );
        assert!(
            deterministic.to_string().contains("dQ launch"),
            "{deterministic}"
        );
        // Devices without `wgmma` and head dims it has no blocks for keep the tile.
        assert_eq!(plan(&caps::a100(), 128, false).warpgroup, None);
        assert_eq!(plan(&h100, 256, false).warpgroup, None);
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
