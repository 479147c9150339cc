//! How a forward runs, decided on the host from the device's features ([`DeviceCaps`]) and what
//! is known of the inputs: the tile, the block shapes, which score inputs are staged in shared
//! memory (a per-pair mask packed into bits first), how a staged bias is added, the grid's
//! order and whether K and V arrive by tensor maps. [`launch`](super::launch) allocates and
//! enqueues what the plan says.

use std::fmt;
use std::sync::OnceLock;

use cubecl::ir::ElemType;

use crate::kernel::config::{
    BiasAdd, MaskConfig, ScoreParams, Staged, Switch, TileConfig, TilePath, WarpgroupConfig,
};
use crate::kernel::device::DeviceCaps;
use crate::kernel::grid::batch_inner;
use crate::kernel::tensors::{BF16, F32, InputFacts, ScoreFacts, U32, layout_tma_aligned};
use crate::kernel::tuning::{choice_override, flag_override, shape_override};
use crate::options::FlashAttentionOptions;

/// What the forward plan is decided on, beside the device.
#[derive(Clone, Copy, Debug)]
pub struct ForwardProblem {
    pub dtype: ElemType,
    pub batch: usize,
    /// Query heads (rows of key/value heads where grouped heads are packed).
    pub heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    /// The score parameters, with the inputs' ([`ScoreParams::with_inputs`]).
    pub params: ScoreParams,
    pub inputs: ScoreFacts,
    /// Each sequence's key length comes from an input ([`TileConfig::key_lengths`]).
    pub key_lengths: bool,
    /// Rows of a page where K and V are paged ([`TileConfig::paged`]).
    pub page_size: Option<usize>,
    /// Sequences are packed along the rows ([`TileConfig::varlen`]): `batch` counts them,
    /// `seq_q` and `seq_k` are the longest one's.
    pub varlen: bool,
    /// K and V can be read through tensor maps ([`tma_aligned`](crate::kernel::tensors::tma_aligned)).
    pub kv_tma_aligned: bool,
}

impl ForwardProblem {
    /// The problem of `q: [b, h, sq, d]` over `k: [b, hkv, sk, d]` and values of head dim
    /// `value_dim`, laid out contiguously, with these options and no mask or bias input.
    pub fn contiguous(
        dtype: ElemType,
        q: [usize; 4],
        k: [usize; 4],
        value_dim: usize,
        options: &FlashAttentionOptions,
    ) -> Self {
        let [batch, heads, seq_q, head_dim] = q;
        let seq_k = k[2];
        let rows = |width: usize| [k[1] * seq_k * width, seq_k * width, width, 1];
        Self {
            dtype,
            batch,
            heads,
            seq_q,
            seq_k,
            head_dim,
            value_dim,
            params: ScoreParams::new(options, heads, head_dim, seq_q, seq_k)
                .with_inputs(None, false),
            inputs: ScoreFacts::default(),
            key_lengths: false,
            page_size: None,
            varlen: false,
            kv_tma_aligned: layout_tma_aligned(0, &rows(head_dim), dtype.size())
                && layout_tma_aligned(0, &rows(value_dim), dtype.size()),
        }
    }
}

/// A forward launch, as planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardPlan {
    /// Everything the kernel specialises on: tile, blocks, staging, grid order, tensor maps.
    pub cfg: TileConfig,
    /// The mask is packed into bits first ([`pack`](crate::kernel::pack)); `cfg.mask.packed`.
    pub pack_mask: bool,
    /// Cubes each row block's keys are split across, their partial outputs merged after the
    /// launch (`cfg.kv_split` where more than 1).
    pub kv_splits: usize,
    /// The Hopper forward on warpgroup products runs instead of `cfg`'s tile
    /// ([`warpgroup`](super::warpgroup), [`warpgroup_blocks`]).
    pub warpgroup: Option<WarpgroupConfig>,
}

/// Whether the fused forward can run inputs of this dtype and head dims on this device, and
/// with which tile. `Err` carries the reason the caller logs before taking the fallback.
pub fn support(
    caps: &DeviceCaps,
    dtype: ElemType,
    head_dim: usize,
    value_dim: usize,
) -> Result<TilePath, String> {
    let tile = caps.tile(dtype, head_dim, value_dim)?;
    let cfg = block_shapes(tile, head_dim, value_dim);
    caps.fits_shared("forward", cfg.shared_bytes(dtype.size()))?;
    Ok(tile)
}

impl ForwardPlan {
    /// The plan of `problem` on `caps`; `Err` where [`support`] refuses it.
    pub fn new(caps: &DeviceCaps, problem: &ForwardProblem) -> Result<Self, String> {
        let ForwardProblem { dtype, params, .. } = *problem;
        let tile = support(caps, dtype, problem.head_dim, problem.value_dim)?;
        let cfg = short_query_shapes(caps, tile, problem)
            .unwrap_or_else(|| block_shapes(tile, problem.head_dim, problem.value_dim))
            .with_scores(&params)
            .with_bounded_max(params.softcap, dtype == BF16 || dtype == F32);
        let (cfg, pack_mask) = stage_inputs(caps, cfg, &problem.inputs, dtype);
        let cfg = match cfg.staged.bias {
            Some(_) => cfg.with_staged(Staged {
                bias_add: bias_add(params.scale, dtype),
                ..cfg.staged
            }),
            None => cfg,
        };
        let bias_batch = problem.inputs.bias.map(|bias| bias.dims[0]);
        let cfg = cfg.with_batch_inner(batch_inner(bias_batch, problem.batch));
        let cfg = if problem.key_lengths {
            cfg.with_key_lengths()
        } else {
            cfg
        };
        let cfg = if problem.varlen {
            cfg.with_varlen()
        } else {
            cfg
        };
        let cfg = match problem.page_size {
            Some(page) if page.is_multiple_of(cfg.block_kv) => cfg.with_pages(),
            Some(page) => {
                return Err(format!(
                    "pages of {page} keys do not hold whole blocks of {}",
                    cfg.block_kv
                ));
            }
            None => cfg,
        };
        let forward_bytes = |cfg: &TileConfig| cfg.shared_bytes(dtype.size());
        // With key lengths a map's box also reads the rows past a sequence's length, which the
        // kernel zeroes in the value stage; a page is a map coordinate like a batch.
        let cfg = if tma_staging(caps, &cfg, problem.kv_tma_aligned, forward_bytes) {
            cfg.with_tma()
        } else {
            cfg
        };
        let kv_splits = kv_splits(caps, &cfg, problem);
        let cfg = if kv_splits > 1 {
            cfg.with_kv_split()
        } else {
            cfg
        };
        Ok(Self {
            cfg,
            pack_mask,
            kv_splits,
            warpgroup: warpgroup_blocks(caps, &cfg, problem).filter(|blocks| {
                cfg!(feature = "cuda")
                    && warpgroup_override().unwrap_or_else(|| warpgroup_pays(blocks, problem))
            }),
        })
    }
}

impl fmt::Display for ForwardPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cfg = &self.cfg;
        if let Some(warpgroup) = &self.warpgroup {
            return write!(
                f,
                "warpgroup tile (wgmma): {} queries × {}-key stages, {} warpgroups and a \
                 producer warp, Q, K and V by tensor maps{}{}{}",
                warpgroup.block_q(),
                WarpgroupConfig::BLOCK_KV,
                warpgroup.warpgroups,
                if warpgroup.causal { ", causal" } else { "" },
                match (warpgroup.mask.0, warpgroup.bias.0) {
                    (true, true) => ", mask packed into bits, bias",
                    (true, false) => ", mask packed into bits",
                    (false, true) => ", bias",
                    (false, false) => "",
                },
                if warpgroup.persistent {
                    ", persistent cubes"
                } else {
                    ""
                }
            );
        }
        write!(
            f,
            "{:?} tile: {} queries × {}-key stages, {} planes",
            cfg.tile, cfg.block_q, cfg.block_kv, cfg.planes
        )?;
        if cfg.tma {
            write!(f, ", K and V by tensor maps")?;
        }
        match (self.pack_mask, cfg.staged.mask, cfg.staged.bias) {
            (true, _, _) => write!(f, ", mask packed into bits and staged")?,
            (false, Some(_), _) => write!(f, ", mask staged")?,
            _ => {}
        }
        if cfg.staged.bias.is_some() {
            write!(f, ", bias staged ({:?})", cfg.staged.bias_add)?;
        }
        if cfg.batch_inner {
            write!(f, ", batches before heads")?;
        }
        if cfg.key_lengths.0 {
            write!(f, ", per-sequence key lengths")?;
        }
        if cfg.paged.0 {
            write!(f, ", paged keys and values")?;
        }
        if cfg.varlen.0 {
            write!(f, ", packed sequences")?;
        }
        if self.kv_splits > 1 {
            write!(
                f,
                ", keys split across {} cubes a row block",
                self.kv_splits
            )?;
        }
        Ok(())
    }
}

/// `BURN_FLASH_WARPGROUP=0|1`: the Hopper forward never or wherever it can run, for tuning runs.
fn warpgroup_override() -> Option<bool> {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_WARPGROUP"))
}

/// `BURN_FLASH_WARPGROUP_INPUTS=0|1`: boolean masks with a row per query and additive biases
/// take the tensor-core tile always, or the Hopper forward wherever it runs
/// (`WarpgroupConfig::mask`, `WarpgroupConfig::bias`; biases at head dim 64 too), for tuning
/// runs.
fn warpgroup_inputs_override() -> Option<bool> {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_WARPGROUP_INPUTS"))
}

/// `BURN_FLASH_WARPGROUP_DROPOUT=0|1`: dropout on the tensor-core tile always, or on the
/// Hopper forward wherever it runs (at head dim 64 over 2048 keys or fewer too), for tuning
/// runs.
fn warpgroup_dropout_override() -> Option<bool> {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_WARPGROUP_DROPOUT"))
}

/// `BURN_FLASH_WARPGROUP_PERSISTENT=0|1`: the Hopper forward's cubes one a query block or
/// persistent (one an SM, walking query blocks in a loop) whatever the mask, for tuning runs.
fn persistent_override() -> Option<bool> {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_WARPGROUP_PERSISTENT"))
}

/// Whether persistent cubes lead one cube a query block. Without a causal mask: at head dim
/// 128, and at 64 below 2048 keys, where its 32 bytes of spills (a store and a load each key
/// block) cost more than the overlap of a block's end with the next one's start saves. Under a
/// causal mask (blocks of unequal lengths, dealt longest first): up to 2048 keys at head dim
/// 128 and 4096 at 64; beyond, one cube a block, launched longest first, balances as well and
/// starts sooner. Measured on the H200 (`docs/perf-notes.md`): head dim 128 plain +8 % at 1k
/// keys, +5 % at 2k, +1–3 % from 4k; 64 plain +4 % at 1k, ±1 % at 2k, −2 % from 4k
/// (2026-11-30); causal 128 +8.5 % at 2k, −1 … −3 % from 4k; causal 64 +4 % at 2k and 4k,
/// −2.5 % from 8k (2026-12-01).
fn persistent_pays(blocks: &WarpgroupConfig, problem: &ForwardProblem) -> bool {
    match (blocks.causal, blocks.head_dim) {
        (false, 128) => true,
        (false, _) => problem.seq_k < 2048,
        (true, 128) => problem.seq_k <= 2048,
        (true, _) => problem.seq_k <= 4096,
    }
}

/// Keys a query block walks from which the Hopper forward leads the tensor-core tile.
const WARPGROUP_MIN_KEYS: usize = 1024;

/// Whether the Hopper forward leads the tensor-core tile on this problem: where every query
/// block is whole and walks 1024 keys or more (half the keys under a causal mask). Measured on
/// the H200 (`docs/hopper.md`): 1.25–1.32× at 2k keys, +13 % at 1k keys (head dim 128; even at
/// 64), +4/+21 % at causal 2k; at 512 keys walked, or with a partial query block, the
/// warpgroups' longer prologue costs more than their products save.
fn warpgroup_pays(blocks: &WarpgroupConfig, problem: &ForwardProblem) -> bool {
    let walked = if blocks.causal {
        problem.seq_k / 2
    } else {
        problem.seq_k
    };
    problem.seq_q >= blocks.block_q() && walked >= WARPGROUP_MIN_KEYS
}

/// The Hopper forward's blocks ([`warpgroup`](super::warpgroup)) where it can run the problem:
/// the tensor-core tile on a device with warpgroup products (SM90: [`DeviceCaps::wgmma`]),
/// head dim 64 or 128 for queries and values alike, plain or causal attention over whole
/// batches of keys, with a boolean mask of a row per query or one for every query, at head
/// dim 128 an additive bias of a row per query over keys in whole 16 bytes, and dropout (at
/// head dim 64 over more than 2048 keys); no other mask or bias input, window's left side,
/// softcap, ALiBi, key lengths, pages, packed sequences or split keys. On persistent cubes
/// where [`persistent_pays`] and the shared memory holds them. `BURN_FLASH_WARPGROUPS=2|3`
/// overrides its warpgroups for tuning runs.
fn warpgroup_blocks(
    caps: &DeviceCaps,
    cfg: &TileConfig,
    problem: &ForwardProblem,
) -> Option<WarpgroupConfig> {
    static WARPGROUPS: OnceLock<Option<usize>> = OnceLock::new();
    let warpgroups = *WARPGROUPS.get_or_init(|| choice_override("BURN_FLASH_WARPGROUPS", &[2, 3]));
    let params = &problem.params;
    let blocks = WarpgroupConfig::new(problem.head_dim, params.mask.right, problem.dtype == BF16);
    let blocks = WarpgroupConfig {
        warpgroups: warpgroups.unwrap_or(blocks.warpgroups),
        ..blocks
    };
    // A boolean mask with a row per query or one for every query (key padding), packed into
    // bits for the warpgroup's blocks, and an additive bias with a row per query and keys in
    // whole 16 bytes (a tensor map's rows).
    // Measured against the tile on the H200 (`docs/perf-notes.md`, 2026-12-01): masks +12…+28 %
    // at head dim 128, −2…+23 % at 64; biases +12…+28 % at 128 but 0…14 % slower at 64, where
    // they stay on the tile unless `BURN_FLASH_WARPGROUP_INPUTS=1` or
    // `testing::force_warpgroup_inputs` asks.
    let asked =
        crate::testing::warpgroup_inputs_forced() || warpgroup_inputs_override() == Some(true);
    let inputs = asked || warpgroup_inputs_override() != Some(false);
    let mask_rows = problem.inputs.mask.map(|facts| facts.dims[2]);
    let masked = inputs && mask_rows.is_some_and(|rows| rows == problem.seq_q || rows == 1);
    let bias = problem.inputs.bias.filter(|facts| {
        inputs
            && (asked || problem.head_dim == 128)
            && facts.dims[2] == problem.seq_q
            && problem.seq_k.is_multiple_of(8)
    });
    // Dropout: measured against the tile on the H200 (`docs/perf-notes.md`, 2026-12-01):
    // +19…+39 % at head dim 128; at 64 +5…+14 % over 8k keys but −6 % causal over 2k.
    let dropout = params.dropout.is_some()
        && warpgroup_dropout_override().unwrap_or(problem.head_dim == 128 || problem.seq_k > 2048);
    let blocks = WarpgroupConfig {
        persistent: persistent_override().unwrap_or_else(|| persistent_pays(&blocks, problem)),
        mask: Switch(masked),
        key_mask: masked && mask_rows == Some(1),
        dropout: Switch(dropout),
        bias: Switch(bias.is_some()),
        bias_steps: bias.map_or((false, false), |facts| {
            (facts.dims[0] != 1, facts.dims[1] != 1)
        }),
        batch_inner: cfg.batch_inner,
        ..blocks
    };
    // Persistent cubes hold two query blocks: with a bias's stages, at head dim 128, more
    // than an SM's shared memory.
    let blocks = WarpgroupConfig {
        persistent: blocks.persistent && caps.fits_shared("forward", blocks.shared_bytes()).is_ok(),
        ..blocks
    };
    let biased = bias.is_some();
    let without_inputs = ScoreParams {
        mask: MaskConfig {
            tensor: false,
            ..params.mask
        },
        bias: false,
        dropout: params.dropout.filter(|_| !dropout),
        ..*params
    };
    let runs = caps.wgmma
        && cfg.tile == TilePath::TensorCore
        && matches!(problem.head_dim, 64 | 128)
        && problem.value_dim == problem.head_dim
        && (masked || problem.inputs.mask.is_none())
        && (biased || problem.inputs.bias.is_none())
        && without_inputs.plain_or_causal()
        && !problem.key_lengths
        && problem.page_size.is_none()
        && !problem.varlen
        && problem.kv_tma_aligned
        && !cfg.kv_split.0
        && caps.fits_shared("forward", blocks.shared_bytes()).is_ok();
    runs.then_some(blocks)
}

/// The block shapes of a forward launch on `tile`.
fn block_shapes(tile: TilePath, head_dim: usize, value_dim: usize) -> TileConfig {
    match tile {
        TilePath::TensorCore => tensor_core_shapes(head_dim, value_dim),
        TilePath::Portable => TileConfig::portable(head_dim, value_dim),
    }
}

/// Block shapes of the tensor-core forward. Up to head dim 128: 4 planes of 32 query rows
/// (128-row query blocks) over 64-key stages, the shape measured fastest on the H100 at head
/// dims 64 and 128 (`docs/perf-notes.md`). Wider heads: 8 planes of 16 rows, so that each unit's
/// output accumulators (16 rows × the value dim per plane) stay at 128 registers.
/// `BURN_FLASH_TC_SHAPE=planes,plane_rows,block_kv` overrides them for tuning runs.
fn tensor_core_shapes(head_dim: usize, value_dim: usize) -> TileConfig {
    let default = if head_dim.max(value_dim) > 128 {
        (8, 16, 64)
    } else {
        (4, 32, 64)
    };
    let (planes, plane_rows, block_kv) = tensor_core_override().unwrap_or(default);
    TileConfig::tensor_core(head_dim, value_dim, planes, plane_rows, block_kv)
}

/// The tensor-core block shape `BURN_FLASH_TC_SHAPE=planes,plane_rows,block_kv` asks for.
fn tensor_core_override() -> Option<(usize, usize, usize)> {
    static OVERRIDE: OnceLock<Option<(usize, usize, usize)>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| shape_override("BURN_FLASH_TC_SHAPE"))
}

/// Block shapes of the tensor-core forward for at most [`SHORT_QUERY_ROWS`] query rows (a
/// decoding step, grouped heads packed into rows, a short speculative chunk) without score
/// inputs, head dims up to 128: 16-row planes, so that a block's rows are not mostly empty and
/// more cubes share an SM. On the H200 at head dim 128 this read the cache at 3.8–4.5 TB/s
/// against 2.5–2.7 with the 128-row blocks (docs/perf-notes.md, 2026-11-29).
///
/// Two KV stages of 64 keys (three one-plane cubes an SM at head dim 128) where the row blocks
/// fit one wave of those; where they take more but fit one wave of 32-key cubes (twice as many
/// an SM) and tensor maps stage them, two 32-key stages, so that no cube waits for a second
/// wave. On the H200 (2026-12-03) 32-key stages read 512 row blocks 0.8–2.1 % faster than three
/// 64-key stages and 0.9–5.3 % faster than two, 2,048 (3.1 waves) 1.4–2.1 % slower than two
/// 64-key stages, 256 (one wave either way) 10–12 % slower. Three stages (two blocks in flight
/// a cube, two cubes an SM) only where a
/// [`force_three_kv_stages`](crate::testing::force_three_kv_stages) guard lives or
/// `BURN_FLASH_KV_STAGES=3`, with tensor maps: on one H200 they read 512 and 2,048 row blocks
/// 0.5–2.4 % faster than two, on another 2,048 2.3–4.9 % slower, and 256 row blocks or split
/// keys 0–3.5 % slower on both.
/// One plane, except where the one-plane grid takes more than one wave but less than two and
/// four planes fill their last wave better: there the short second wave is the tail (with two
/// stages, four planes read 512 row blocks 5–7 % faster than one on the H200, 2026-11-30).
/// `None` elsewhere, or where `BURN_FLASH_TC_SHAPE` decides; `BURN_FLASH_DECODE_BLOCK_KV`
/// decides the keys per stage.
fn short_query_shapes(
    caps: &DeviceCaps,
    tile: TilePath,
    problem: &ForwardProblem,
) -> Option<TileConfig> {
    let plain = problem.inputs.mask.is_none()
        && problem.inputs.bias.is_none()
        && problem.params.dropout.is_none();
    let short = tile == TilePath::TensorCore
        && problem.seq_q <= SHORT_QUERY_ROWS
        && problem.head_dim.max(problem.value_dim) <= 128
        && plain
        && tensor_core_override().is_none();
    let sms = caps.sms.filter(|_| short)?;
    let shapes = |planes, block_kv, three| {
        TileConfig::tensor_core(problem.head_dim, problem.value_dim, planes, 16, block_kv)
            .with_three_kv_stages(three)
    };
    // One row block per (batch, head): the query rows fit one plane's 16.
    let row_blocks = problem.heads * problem.batch;
    let bytes = |cfg: &TileConfig| cfg.shared_bytes(problem.dtype.size());
    let per_sm = |cfg: &TileConfig| caps.cubes_per_sm(bytes(cfg), cfg.units());
    let slots = |cfg: &TileConfig| sms * per_sm(cfg);
    let by_maps = |cfg: &TileConfig| tma_staging(caps, cfg, problem.kv_tma_aligned, bytes);
    let three_wanted = crate::testing::three_kv_stages_forced() || kv_stages_override() == Some(3);
    let three = three_wanted && by_maps(&shapes(1, 64, true));
    let one_wave = |block_kv| row_blocks <= slots(&shapes(1, block_kv, false));
    let block_kv = decode_block_kv_override().unwrap_or(
        if !three && !one_wave(64) && one_wave(32) && by_maps(&shapes(1, 32, false)) {
            32
        } else {
            64
        },
    );
    let last_wave_fill =
        |slots: usize| row_blocks as f64 / (row_blocks.div_ceil(slots) * slots) as f64;
    let (one, four) = (
        slots(&shapes(1, block_kv, three)),
        slots(&shapes(4, block_kv, three)),
    );
    let tail = row_blocks > one && row_blocks < 2 * one;
    let planes = if tail && last_wave_fill(four) > last_wave_fill(one) {
        4
    } else {
        1
    };
    Some(shapes(planes, block_kv, three))
}

/// `BURN_FLASH_KV_STAGES=2|3`: the key/value stages of [`short_query_shapes`] (tuning runs).
fn kv_stages_override() -> Option<usize> {
    static OVERRIDE: OnceLock<Option<usize>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| choice_override("BURN_FLASH_KV_STAGES", &[2, 3]))
}

/// `BURN_FLASH_DECODE_BLOCK_KV=32|64`: the keys per stage of [`short_query_shapes`] (tuning
/// runs).
fn decode_block_kv_override() -> Option<usize> {
    static OVERRIDE: OnceLock<Option<usize>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| choice_override("BURN_FLASH_DECODE_BLOCK_KV", &[32, 64]))
}

/// The query rows up to which [`short_query_shapes`] applies: one 16-row plane.
const SHORT_QUERY_ROWS: usize = 16;

/// Cubes each row block's keys are split across: [`ScoreParams::kv_splits`] where the caller
/// chose, else more than one only where every (batch, head) pair is one row block (decoding,
/// speculative verification) and those blocks are fewer than the device's SMs. Then the
/// smallest power of two that gives 1.5 cubes an SM or more, each split keeping a key block at
/// least, at most [`MAX_SPLITS`]. On the H200 at head dim 128, 32 row blocks over 4k–128k keys
/// ran 2.1–5.1× faster split 8 ways than whole, and 256 row blocks whole within 2 % of split
/// or faster (docs/perf-notes.md, 2026-11-29). Splits of a single block are the fastest where
/// the row blocks are few since the merge's loads are unrolled ([`combine`](super::combine)):
/// 4 row blocks over 4k keys took 0.0149 ms split 64 ways, 0.0164 split 16 ways (H200,
/// 2026-11-30).
/// `BURN_FLASH_KV_SPLITS=N` (any count up to [`MAX_SPLITS`]) decides instead (tuning runs).
fn kv_splits(caps: &DeviceCaps, cfg: &TileConfig, problem: &ForwardProblem) -> usize {
    static OVERRIDE: OnceLock<Option<usize>> = OnceLock::new();
    let forced = *OVERRIDE.get_or_init(|| {
        let counts: Vec<usize> = (1..=MAX_SPLITS).collect();
        choice_override("BURN_FLASH_KV_SPLITS", &counts)
    });
    if problem.varlen {
        // The partial outputs' merge reads whole `[b, h, sq]` rows, not packed ones.
        return 1;
    }
    if let Some(splits) = forced.or(problem.params.kv_splits) {
        return splits;
    }
    let Some(sms) = caps.sms else {
        return 1;
    };
    let row_blocks = problem.seq_q.div_ceil(cfg.block_q) * problem.heads * problem.batch;
    if problem.seq_q > cfg.block_q || row_blocks >= sms {
        return 1;
    }
    let most = problem.seq_k.div_ceil(cfg.block_kv).clamp(1, MAX_SPLITS);
    let mut splits = 1;
    while splits * 2 <= most && 2 * row_blocks * splits < 3 * sms {
        splits *= 2;
    }
    splits
}

/// The most cubes one row block's keys are split across.
const MAX_SPLITS: usize = 64;

/// Whether a launch with blocks `cfg` stages its staged operands (K and V in the forward, Q and
/// dO in the dK/dV launch) by tensor maps ([`TileConfig::tma`]): the device has the copy engine
/// (CUDA from SM90), the blocks allow it, the operands are `aligned` as a tensor map needs, and
/// the cube's shared memory (`shared_bytes`) still fits with the stages' 1024-byte alignment.
/// Otherwise every unit issues its 16-byte copies, as while a
/// [`avoid_tma`](crate::testing::avoid_tma) guard lives or with `BURN_FLASH_TMA=0` (tuning
/// runs).
pub(crate) fn tma_staging(
    caps: &DeviceCaps,
    cfg: &TileConfig,
    aligned: bool,
    shared_bytes: impl Fn(&TileConfig) -> usize,
) -> bool {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    let wanted = OVERRIDE
        .get_or_init(|| flag_override("BURN_FLASH_TMA"))
        .unwrap_or(true);
    wanted
        && !crate::testing::tma_avoided()
        && caps.tma
        && cfg.can_stage_by_tma()
        && aligned
        && caps
            .fits_shared("tensor-map staged", shared_bytes(&cfg.with_tma()))
            .is_ok()
}

/// `cfg` with the score inputs it stages, and whether the mask is packed into bits first: a
/// per-pair mask where the tensor-core forward stages it, so that it also skips the blocks the
/// mask hides wholly.
fn stage_inputs(
    caps: &DeviceCaps,
    cfg: TileConfig,
    inputs: &ScoreFacts,
    dtype: ElemType,
) -> (TileConfig, bool) {
    let packs = cfg.tile == TilePath::TensorCore
        && cfg.mask.tensor
        && !cfg.mask.per_key
        && cfg.block_kv.is_multiple_of(32);
    if packs {
        let packed_cfg = cfg.with_packed_mask(true);
        let staged = staging(caps, &packed_cfg, inputs, dtype);
        if staged.mask.is_some() {
            return (packed_cfg.with_staged(staged), true);
        }
    }
    let staged = staging(caps, &cfg, inputs, dtype);
    (cfg.with_staged(staged), false)
}

/// The score inputs the tensor-core forward stages in shared memory ([`Staged`]): a packed mask
/// (always whole 16-byte chunks), an unpacked mask and a bias whose rows are whole 16-byte chunks
/// (`seq_k` a multiple of the chunk: every stride of a contiguous input is a multiple of
/// `seq_k`, and buffers start aligned), a bias only where a block's row fills whole 128-byte
/// lines (its `ldmatrix` swizzle), as many of them as the device's shared memory holds beside
/// the K/V stages (the mask first, the smaller). The others are read in place. The bias gets one
/// stage instead of two where that keeps more cubes per SM (head dim 128 on an H100).
/// `BURN_FLASH_STAGE_INPUTS=0` reads both in place (tuning runs).
fn staging(caps: &DeviceCaps, cfg: &TileConfig, inputs: &ScoreFacts, dtype: ElemType) -> Staged {
    static DISABLED: OnceLock<bool> = OnceLock::new();
    let disabled =
        DISABLED.get_or_init(|| std::env::var("BURN_FLASH_STAGE_INPUTS").is_ok_and(|v| v == "0"));
    if cfg.tile != TilePath::TensorCore || *disabled {
        return Staged::default();
    }
    let chunk = |input: Option<InputFacts>| {
        let input = input?;
        let chunk = 16 / input.elem_size;
        let seq_k = input.dims[3];
        (seq_k.is_multiple_of(chunk) && cfg.block_kv.is_multiple_of(chunk)).then_some(chunk)
    };
    let mask = if cfg.mask.packed {
        inputs.mask.map(|_| 16 / U32.size())
    } else {
        chunk(inputs.mask)
    };
    let bias = chunk(inputs.bias).filter(|&chunk| (cfg.block_kv / chunk).is_multiple_of(8));
    let bytes = |staged: Staged| cfg.with_staged(staged).shared_bytes(dtype.size());
    let staged = [
        Staged {
            mask,
            bias,
            ..Staged::default()
        },
        Staged {
            mask,
            ..Staged::default()
        },
        Staged {
            bias,
            ..Staged::default()
        },
    ]
    .into_iter()
    .find(|&staged| caps.fits_shared("forward", bytes(staged)).is_ok())
    .unwrap_or_default();
    if staged.bias.is_none() {
        return staged;
    }
    let single = Staged {
        bias_single: true,
        ..staged
    };
    static STAGES: OnceLock<Option<usize>> = OnceLock::new();
    let prefer_single =
        match STAGES.get_or_init(|| choice_override("BURN_FLASH_BIAS_STAGES", &[1, 2])) {
            Some(stages) => *stages == 1,
            None => {
                let units = cfg.units();
                caps.cubes_per_sm(bytes(single), units) > caps.cubes_per_sm(bytes(staged), units)
            }
        };
    if prefer_single { single } else { staged }
}

/// How the tensor-core forward adds a staged bias ([`BiasAdd`]): bf16 by the tensor cores where
/// bf16 holds `1 / scale` exactly (head dims 16, 64 and 256 at the default scale) and that
/// factor exceeds 1.004 (so that the lowest finite bf16 times it overflows to the `-inf` it
/// stands for); else converted per score. `BURN_FLASH_BIAS_MMA=0` converts always (tuning
/// runs).
fn bias_add(scale: f32, dtype: ElemType) -> BiasAdd {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    let factor = 1.0 / scale;
    let exact = half::bf16::from_f32(factor).to_f32() == factor;
    let overflows = (half::bf16::MIN.to_f32() * factor).is_infinite();
    let forced_off = *OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_BIAS_MMA")) == Some(false);
    if dtype == BF16 && exact && overflows && !forced_off {
        BiasAdd::Mma
    } else {
        BiasAdd::Convert
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::device::caps;
    use crate::options::{AttentionWindow, FlashAttentionOptions};

    fn problem(d: usize, options: FlashAttentionOptions, inputs: ScoreFacts) -> ForwardProblem {
        let mask_dims = inputs.mask.map(|mask| mask.dims);
        ForwardProblem {
            dtype: BF16,
            batch: 4,
            heads: 16,
            seq_q: 4096,
            seq_k: 4096,
            head_dim: d,
            value_dim: d,
            params: ScoreParams::new(&options, 16, d, 4096, 4096).with_inputs(
                mask_dims.as_ref().map(|dims| &dims[..]),
                inputs.bias.is_some(),
            ),
            inputs,
            key_lengths: false,
            page_size: None,
            varlen: false,
            kv_tma_aligned: true,
        }
    }

    /// The Hopper forward takes plain and causal attention at head dims 64 and 128 on SM90, and
    /// leaves every other problem to the tensor-core tile.
    #[test]
    fn warpgroup_forward_where_it_covers_the_problem() {
        let blocks = |caps: &DeviceCaps, problem: &ForwardProblem| {
            let cfg = ForwardPlan::new(caps, problem).unwrap().cfg;
            warpgroup_blocks(caps, &cfg, problem)
        };
        let causal = FlashAttentionOptions::new().with_causal(true);
        let plain = problem(64, FlashAttentionOptions::new(), ScoreFacts::default());
        assert_eq!(
            blocks(&caps::h100(), &plain),
            Some(WarpgroupConfig::new(64, false, true)),
            "one cube a query block at head dim 64 over 4k keys"
        );
        let short = ForwardProblem {
            seq_k: 1024,
            ..plain
        };
        let persistent = |problem: &ForwardProblem| {
            blocks(&caps::h100(), problem).map(|blocks| blocks.persistent)
        };
        assert_eq!(persistent(&short), Some(true), "head dim 64, 1k keys");
        let plain_128 = problem(128, FlashAttentionOptions::new(), ScoreFacts::default());
        assert_eq!(persistent(&plain_128), Some(true), "head dim 128, 4k keys");
        let d128 = problem(128, causal, ScoreFacts::default());
        let wide = blocks(&caps::h100(), &d128).expect("causal head dim 128");
        assert_eq!(
            (wide.warpgroups, wide.causal, wide.persistent),
            (2, true, false),
            "causal blocks one a cube over 4k keys at head dim 128"
        );
        let causal_at = |d: usize, seq: usize| ForwardProblem {
            seq_q: seq,
            seq_k: seq,
            ..problem(d, causal, ScoreFacts::default())
        };
        assert_eq!(
            persistent(&causal_at(128, 2048)),
            Some(true),
            "causal 128, 2k"
        );
        assert_eq!(
            persistent(&causal_at(64, 4096)),
            Some(true),
            "causal 64, 4k"
        );
        assert_eq!(
            persistent(&causal_at(64, 8192)),
            Some(false),
            "causal 64, 8k"
        );
        assert_eq!(
            blocks(&caps::a100(), &plain),
            None,
            "no tensor maps before SM90"
        );
        let d96 = problem(96, FlashAttentionOptions::new(), ScoreFacts::default());
        assert_eq!(blocks(&caps::h100(), &d96), None);
        // Masks with a row per query and, at head dim 128, biases with one and keys in whole
        // 16 bytes take the Hopper forward (`BURN_FLASH_WARPGROUP_INPUTS` unset in tests);
        // biases at 64 only where asked.
        let inputs = |d: usize, mask: Option<[usize; 4]>, bias: Option<[usize; 4]>| {
            let facts = |dims: Option<[usize; 4]>, elem_size| {
                dims.map(|dims| InputFacts { elem_size, dims })
            };
            let inputs = ScoreFacts {
                mask: facts(mask, 1),
                bias: facts(bias, 2),
            };
            problem(d, FlashAttentionOptions::new(), inputs)
        };
        let mask = inputs(128, Some([4, 1, 4096, 4096]), None);
        let bias = inputs(128, None, Some([1, 16, 4096, 4096]));
        let bias_64 = inputs(64, None, Some([1, 16, 4096, 4096]));
        assert_eq!(
            blocks(&caps::h100(), &bias_64),
            None,
            "a bias at 64, not asked"
        );
        let masked = blocks(&caps::h100(), &mask).expect("a mask with a row per query");
        assert!(masked.mask.0 && !masked.key_mask && !masked.bias.0);
        let keys = blocks(&caps::h100(), &inputs(64, Some([4, 1, 1, 4096]), None))
            .expect("a mask of one row for every query");
        assert!(keys.mask.0 && keys.key_mask);
        assert_eq!(
            blocks(&caps::h100(), &inputs(64, Some([4, 1, 2048, 4096]), None)),
            None,
            "a mask of half the queries' rows"
        );
        let biased = blocks(&caps::h100(), &bias).expect("a bias");
        assert!(biased.bias.0 && biased.bias_steps == (false, true) && !biased.persistent);
        assert!(biased.batch_inner, "one bias for a batch of four");
        let both = inputs(128, Some([4, 1, 4096, 4096]), Some([4, 1, 4096, 4096]));
        let both = blocks(&caps::h100(), &both).expect("a mask and a bias");
        assert!(both.mask.0 && both.bias.0 && both.bias_steps == (true, false));
        let asked = crate::testing::force_warpgroup_inputs();
        assert!(
            blocks(&caps::h100(), &bias_64).is_some(),
            "a bias at head dim 64, asked"
        );
        drop(asked);
        assert_eq!(
            blocks(&caps::h100(), &inputs(128, None, Some([1, 16, 1, 4096]))),
            None,
            "a bias of one row for every query"
        );
        let window = problem(
            64,
            causal.with_window(AttentionWindow::new(Some(256), Some(0))),
            ScoreFacts::default(),
        );
        assert_eq!(blocks(&caps::h100(), &window), None);
        let dropout = problem(64, causal.with_dropout(0.1, 7), ScoreFacts::default());
        let dropped = blocks(&caps::h100(), &dropout).expect("dropout over 4096 keys");
        assert!(dropped.dropout.0 && dropped.causal);
        let short = ForwardProblem {
            seq_q: 2048,
            seq_k: 2048,
            ..dropout
        };
        assert_eq!(
            blocks(&caps::h100(), &short),
            None,
            "dropout at 64 over 2048 keys: the tile"
        );
        let softcap = problem(64, causal.with_softcap(30.0), ScoreFacts::default());
        assert_eq!(blocks(&caps::h100(), &softcap), None);
        let lengths = ForwardProblem {
            key_lengths: true,
            ..plain
        };
        assert_eq!(blocks(&caps::h100(), &lengths), None);
        let decode = ForwardProblem {
            seq_q: 1,
            batch: 1,
            heads: 8,
            ..plain
        };
        assert_eq!(blocks(&caps::h100(), &decode), None, "split keys");
        // SM100 has tensor maps but no warpgroup products.
        let sm100 = DeviceCaps {
            wgmma: false,
            ..caps::h100()
        };
        assert_eq!(blocks(&sm100, &plain), None);
    }

    /// By default the Hopper forward takes whole query blocks over 1024 walked keys or more.
    #[test]
    fn warpgroup_forward_by_default_over_long_keys() {
        let at = |seq_q: usize, seq_k: usize, causal: bool| {
            let options = FlashAttentionOptions::new().with_causal(causal);
            let problem = ForwardProblem {
                seq_q,
                seq_k,
                ..problem(64, options, ScoreFacts::default())
            };
            let cfg = ForwardPlan::new(&caps::h100(), &problem).unwrap().cfg;
            warpgroup_blocks(&caps::h100(), &cfg, &problem)
                .is_some_and(|blocks| warpgroup_pays(&blocks, &problem))
        };
        assert!(at(4096, 4096, false));
        assert!(at(1024, 1024, false));
        assert!(!at(512, 512, false), "short keys: the tile");
        assert!(at(2048, 2048, true), "causal 2k walks 1k keys");
        assert!(!at(1024, 1024, true), "causal 1k walks 512 keys");
        assert!(!at(100, 4096, false), "a partial query block");
    }

    /// Contiguous inputs on an SM90 device take the Hopper forward by the default rule in a
    /// CUDA build (what `flash_attention_plan` reports), never in another build.
    #[test]
    fn contiguous_inputs_take_the_hopper_forward_by_the_rule() {
        if warpgroup_override().is_some() {
            println!("skipped: BURN_FLASH_WARPGROUP overrides the rule");
            return;
        }
        let taken = |d: usize, n: usize, causal: bool, dtype: ElemType| {
            let dims = [16384 / n, 2048 / d, n, d];
            let options = FlashAttentionOptions::new().with_causal(causal);
            let problem = ForwardProblem::contiguous(dtype, dims, dims, d, &options);
            ForwardPlan::new(&caps::h100(), &problem)
                .unwrap()
                .warpgroup
                .is_some()
        };
        let cuda = cfg!(feature = "cuda");
        assert_eq!(taken(64, 1024, false, BF16), cuda);
        assert_eq!(
            taken(128, 2048, true, BF16),
            cuda,
            "causal 2k walks 1k keys"
        );
        assert!(!taken(64, 512, false, BF16), "512 keys: the tile");
        assert!(!taken(128, 1024, true, BF16), "causal 1k walks 512 keys");
        assert!(!taken(256, 2048, false, BF16), "head dim 256");
        assert!(!taken(64, 4096, false, F32), "f32: the portable tile");
    }

    #[test]
    fn tensor_cores_where_the_device_has_them() {
        let plain = problem(64, FlashAttentionOptions::new(), ScoreFacts::default());
        let h100 = ForwardPlan::new(&caps::h100(), &plain).unwrap();
        assert_eq!(h100.cfg.tile, TilePath::TensorCore);
        assert_eq!((h100.cfg.block_q, h100.cfg.block_kv), (128, 64));
        assert!(h100.cfg.tma, "K and V by tensor maps on SM90");
        let a100 = ForwardPlan::new(&caps::a100(), &plain).unwrap();
        assert!(!a100.cfg.tma, "no tensor maps before SM90");
        let portable = ForwardPlan::new(&caps::lavapipe(), &plain).unwrap();
        assert_eq!(portable.cfg.tile, TilePath::Portable);
        // f32 takes the portable tile even where tensor cores exist; head dim 72 has no
        // tensor-core tile and is refused with the reason.
        let f32 = ForwardProblem {
            dtype: F32,
            ..plain
        };
        assert_eq!(
            ForwardPlan::new(&caps::h100(), &f32).unwrap().cfg.tile,
            TilePath::Portable
        );
        let d72 = problem(72, FlashAttentionOptions::new(), ScoreFacts::default());
        let reason = ForwardPlan::new(&caps::h100(), &d72).unwrap_err();
        assert!(reason.contains("head dims"), "{reason}");
        // Wide heads: 8 planes of 16 rows.
        let d256 = ForwardPlan::new(
            &caps::h100(),
            &problem(256, FlashAttentionOptions::new(), ScoreFacts::default()),
        )
        .unwrap();
        assert_eq!((d256.cfg.planes, d256.cfg.plane_rows), (8, 16));
    }

    #[test]
    fn a_per_pair_mask_is_packed_and_staged() {
        let mask = InputFacts {
            elem_size: 1,
            dims: [4, 16, 4096, 4096],
        };
        let inputs = ScoreFacts {
            mask: Some(mask),
            bias: None,
        };
        let plan = ForwardPlan::new(
            &caps::h100(),
            &problem(64, FlashAttentionOptions::new(), inputs),
        )
        .unwrap();
        assert!(plan.pack_mask && plan.cfg.mask.packed);
        assert!(plan.to_string().contains("mask packed into bits"), "{plan}");
        assert_eq!(
            plan.cfg.staged.mask,
            Some(4),
            "four u32 words per 16-byte copy"
        );
        // A mask the same for every query is read in place, never packed.
        let per_key = ScoreFacts {
            mask: Some(InputFacts {
                dims: [4, 16, 1, 4096],
                ..mask
            }),
            bias: None,
        };
        let plan = ForwardPlan::new(
            &caps::h100(),
            &problem(64, FlashAttentionOptions::new(), per_key),
        )
        .unwrap();
        assert!(!plan.pack_mask && !plan.cfg.mask.packed);
        // The portable tile stages nothing.
        let plan = ForwardPlan::new(
            &caps::lavapipe(),
            &problem(64, FlashAttentionOptions::new(), inputs),
        )
        .unwrap();
        assert!(!plan.pack_mask && plan.cfg.staged == Staged::default());
    }

    #[test]
    fn a_bias_shared_by_the_batch_turns_the_grid_around() {
        let bias = |batch| ScoreFacts {
            mask: None,
            bias: Some(InputFacts {
                elem_size: 2,
                dims: [batch, 16, 4096, 4096],
            }),
        };
        let shared = ForwardPlan::new(
            &caps::h100(),
            &problem(64, FlashAttentionOptions::new(), bias(1)),
        )
        .unwrap();
        assert!(shared.cfg.batch_inner);
        assert_eq!(shared.cfg.staged.bias, Some(8));
        let own = ForwardPlan::new(
            &caps::h100(),
            &problem(64, FlashAttentionOptions::new(), bias(4)),
        )
        .unwrap();
        assert!(!own.cfg.batch_inner);
        // At the default scale of head dim 64 (1/8) bf16 holds 1/scale exactly: the tensor
        // cores add the staged bias.
        assert_eq!(own.cfg.staged.bias_add, BiasAdd::Mma);
    }

    #[test]
    fn keys_split_where_one_query_block_per_head_leaves_sms_idle() {
        let decode = |batch: usize, heads: usize, seq_q: usize, seq_k: usize| ForwardProblem {
            batch,
            heads,
            seq_q,
            seq_k,
            params: ScoreParams::new(&FlashAttentionOptions::causal(), heads, 128, seq_q, seq_k),
            ..problem(128, FlashAttentionOptions::causal(), ScoreFacts::default())
        };
        let splits = |caps: &DeviceCaps, problem: &ForwardProblem| {
            let plan = ForwardPlan::new(caps, problem).unwrap();
            assert_eq!(plan.cfg.kv_split.0, plan.kv_splits > 1);
            plan.kv_splits
        };
        let h100 = caps::h100();
        // 32 row blocks on 132 SMs: 8 splits give 256 cubes, 1.9 an SM.
        assert_eq!(splits(&h100, &decode(1, 32, 1, 16384)), 8);
        // 4 row blocks: 64 splits, 256 cubes; each split keeps a key block of 64 at least, so
        // 512 keys split 8 ways and 100 keys 2 ways.
        assert_eq!(splits(&h100, &decode(1, 4, 1, 4096)), 64);
        assert_eq!(splits(&h100, &decode(1, 32, 1, 512)), 8);
        assert_eq!(splits(&h100, &decode(1, 32, 1, 100)), 2);
        assert_eq!(splits(&h100, &decode(1, 32, 1, 64)), 1);
        // 256 row blocks fill the SMs; so do long query blocks.
        assert_eq!(splits(&h100, &decode(8, 32, 1, 16384)), 1);
        assert_eq!(splits(&h100, &decode(1, 4, 1024, 16384)), 1);
        // The caller's choice stands; without an SM count nothing is split.
        let chosen = decode(8, 32, 1, 16384);
        let chosen = ForwardProblem {
            params: chosen.params.with_kv_splits(4),
            ..chosen
        };
        assert_eq!(splits(&h100, &chosen), 4);
        let lavapipe = ForwardProblem {
            dtype: F32,
            head_dim: 64,
            value_dim: 64,
            ..decode(1, 32, 1, 16384)
        };
        assert_eq!(splits(&caps::lavapipe(), &lavapipe), 1);
    }

    #[test]
    fn short_queries_take_16_row_planes() {
        let decode = |batch: usize, heads: usize, seq_q: usize, d: usize| ForwardProblem {
            batch,
            heads,
            seq_q,
            seq_k: 16384,
            params: ScoreParams::new(&FlashAttentionOptions::causal(), heads, d, seq_q, 16384),
            ..problem(d, FlashAttentionOptions::causal(), ScoreFacts::default())
        };
        let shape = |problem: &ForwardProblem| {
            let cfg = ForwardPlan::new(&caps::h100(), problem).unwrap().cfg;
            (cfg.planes, cfg.plane_rows, cfg.block_kv)
        };
        // 8 key/value heads of 4 packed query rows, 64 row blocks on 132 SMs: one plane, keys
        // split, two KV stages. One-plane cubes of two 64-key stages (three an SM) hold 396
        // row blocks at once: 256 keep them; 512 take 32-key stages (one wave of those), 2,048
        // (more than a wave either way) 64-key ones.
        let stages = |problem: &ForwardProblem| {
            let cfg = ForwardPlan::new(&caps::h100(), problem).unwrap().cfg;
            (cfg.planes, cfg.kv_stages())
        };
        assert_eq!(shape(&decode(8, 8, 4, 128)), (1, 16, 64));
        assert_eq!(stages(&decode(8, 8, 4, 128)), (1, 2));
        assert_eq!(stages(&decode(8, 32, 1, 128)), (1, 2));
        assert_eq!(shape(&decode(8, 32, 1, 128)), (1, 16, 64));
        assert_eq!(shape(&decode(64, 8, 4, 128)), (1, 16, 32));
        assert_eq!(stages(&decode(64, 8, 4, 128)), (1, 2));
        assert_eq!(shape(&decode(64, 32, 1, 128)), (1, 16, 64));
        assert_eq!(stages(&decode(64, 32, 1, 128)), (1, 2));
        // Three 64-key stages only where forced (and tensor maps stage them).
        let three = crate::testing::force_three_kv_stages();
        assert_eq!(stages(&decode(64, 8, 4, 128)), (1, 3));
        assert_eq!(shape(&decode(64, 8, 4, 128)), (1, 16, 64));
        assert_eq!(stages(&decode(8, 32, 1, 128)), (1, 3));
        drop(three);
        // Keys and values that tensor maps cannot stage keep 64-key stages (32 were measured
        // with maps only), and so the tail rule: four planes for 512 row blocks.
        let unaligned = ForwardProblem {
            kv_tma_aligned: false,
            ..decode(64, 8, 4, 128)
        };
        assert_eq!(stages(&unaligned), (4, 2));
        assert_eq!(shape(&unaligned), (4, 16, 64));
        // Longer query blocks, wider heads and score inputs keep the default shapes.
        assert_eq!(shape(&decode(8, 8, 17, 128)), (4, 32, 64));
        assert_eq!(shape(&decode(8, 8, 4, 256)), (8, 16, 64));
        let masked = ForwardProblem {
            inputs: ScoreFacts {
                mask: Some(InputFacts {
                    elem_size: 1,
                    dims: [8, 1, 1, 16384],
                }),
                bias: None,
            },
            ..decode(8, 8, 4, 128)
        };
        assert_eq!(shape(&masked), (4, 32, 64));
    }

    #[test]
    fn key_lengths_keep_the_decode_shapes() {
        let ragged = ForwardProblem {
            batch: 8,
            heads: 8,
            seq_q: 4,
            seq_k: 16384,
            key_lengths: true,
            ..problem(128, FlashAttentionOptions::causal(), ScoreFacts::default())
        };
        let plan = ForwardPlan::new(&caps::h100(), &ragged).unwrap();
        assert!(plan.cfg.key_lengths.0);
        assert!(
            plan.cfg.tma,
            "K and V by tensor maps, the rows past a length zeroed"
        );
        assert_eq!((plan.cfg.planes, plan.cfg.plane_rows), (1, 16));
        assert!(plan.kv_splits > 1);
        assert!(plan.to_string().contains("per-sequence key lengths"));
        let equal = ForwardProblem {
            key_lengths: false,
            ..ragged
        };
        let plan = ForwardPlan::new(&caps::h100(), &equal).unwrap();
        assert!(!plan.cfg.key_lengths.0);
        // Pages hold whole key blocks of 64, or the plan refuses them.
        let paged = |page_size| ForwardProblem {
            page_size: Some(page_size),
            ..ragged
        };
        let plan = ForwardPlan::new(&caps::h100(), &paged(256)).unwrap();
        assert!(plan.cfg.paged.0 && plan.cfg.tma);
        assert!(plan.to_string().contains("paged"));
        assert!(ForwardPlan::new(&caps::h100(), &paged(96)).is_err());
        // The portable tile's blocks of 16 keys fit pages of 64.
        let portable = ForwardProblem {
            dtype: F32,
            ..paged(64)
        };
        assert!(
            ForwardPlan::new(&caps::lavapipe(), &portable)
                .unwrap()
                .cfg
                .paged
                .0
        );
    }
}
