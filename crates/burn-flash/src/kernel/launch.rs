//! Launch: pick the tile from the device's features, shape the grid, allocate the outputs.

use std::sync::OnceLock;

use burn::tensor::{BoolStore, DType, Shape};
use burn_cubecl::kernel::{bool_cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::features::{MmaConfig, Plane, Tma};
use cubecl::prelude::*;
use cubecl::tensor_vector_size_parallel;

use super::TilePath;
use super::config::{BiasAdd, CHUNK, ScoreParams, Staged, TileConfig};
use super::forward::flash_forward;
use super::grid::{batch_inner, cube_count};
use super::pack::pack_mask;
use super::tile::{MmaTile, PortableTile};

/// Largest head dim the portable tile unrolls (its query and output rows live in registers).
const PORTABLE_MAX_DIM: usize = 256;

/// Head dims of queries/keys and of values the tensor-core tile is built for: its score product
/// takes 32 columns per step of its loop, and its blocks are tuned per head dim.
pub(crate) const TENSOR_CORE_DIMS: [usize; 5] = [32, 64, 96, 128, 256];

/// Decide whether the fused forward can run inputs of this dtype and head dims on this client,
/// and with which tile. `Err` carries the reason the caller logs before taking the fallback.
pub fn support<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dtype: DType,
    head_dim: usize,
    value_dim: usize,
) -> Result<TilePath, String> {
    let tile = usable_tile(client, dtype, head_dim, value_dim)?;
    let cfg = forward_config(tile, head_dim, value_dim);
    fits_shared(client, "forward", cfg.shared_bytes(dtype.size()))?;
    Ok(tile)
}

/// The tile for this dtype and head dims on this client, shared memory not yet checked: tensor
/// cores where the device has `mma.sync` m16n8k16 for the dtype (f16, bf16), `ldmatrix`,
/// asynchronous copies and 32-lane planes; else the portable tile.
pub(crate) fn usable_tile<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dtype: DType,
    head_dim: usize,
    value_dim: usize,
) -> Result<TilePath, String> {
    let props = client.properties();
    let features = &props.features;
    let elem: StorageType = dtype.into();
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return Err(format!("dtype {dtype:?} is not f16, bf16 or f32"));
    }
    if !features.types.storage.contains_key(&elem) {
        return Err(format!("dtype {dtype:?} is not supported by this runtime"));
    }

    let mma = MmaConfig {
        a_type: elem,
        b_type: elem,
        cd_type: DType::F32.into(),
        m: 16,
        n: 8,
        k: 16,
    };
    let has_tensor_cores = features.matmul.mma.contains(&mma)
        && features.matmul.ldmatrix.contains(&elem)
        && features.copy_async
        && features.plane.contains(Plane::Ops)
        && props.hardware.plane_size_min == 32
        && props.hardware.plane_size_max == 32;
    if dtype != DType::F32 && has_tensor_cores {
        if !TENSOR_CORE_DIMS.contains(&head_dim) || !TENSOR_CORE_DIMS.contains(&value_dim) {
            return Err(format!(
                "the tensor-core kernel supports head dims {TENSOR_CORE_DIMS:?} (q/k {head_dim}, v {value_dim})"
            ));
        }
        return Ok(TilePath::TensorCore);
    }
    if head_dim == 0
        || value_dim == 0
        || head_dim > PORTABLE_MAX_DIM
        || value_dim > PORTABLE_MAX_DIM
    {
        return Err(format!(
            "the portable kernel supports head dims 1..={PORTABLE_MAX_DIM} (q/k {head_dim}, v {value_dim})"
        ));
    }
    Ok(TilePath::Portable)
}

/// `Err` when a `kernel` launch needing `bytes` of shared memory per cube does not fit.
pub(crate) fn fits_shared<R: CubeRuntime>(
    client: &ComputeClient<R>,
    kernel: &str,
    bytes: usize,
) -> Result<(), String> {
    let available = client.properties().hardware.max_shared_memory_size;
    if bytes > available {
        return Err(format!(
            "the {kernel} kernel needs {bytes} bytes of shared memory, the device has {available}"
        ));
    }
    Ok(())
}

/// The block shapes of a forward launch on `tile`.
fn forward_config(tile: TilePath, head_dim: usize, value_dim: usize) -> TileConfig {
    match tile {
        TilePath::TensorCore => tensor_core_config(head_dim, value_dim),
        TilePath::Portable => TileConfig::portable(head_dim, value_dim),
    }
}

/// `0` (false) or `1` (true) from environment variable `name` (tuning runs), if set and valid.
pub(crate) fn flag_override(name: &str) -> Option<bool> {
    let text = std::env::var(name).ok()?;
    let flag = match text.trim() {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    };
    if flag.is_none() {
        log::warn!("ignoring {name}={text:?}: expected 0 or 1");
    }
    flag
}

/// `planes,plane_rows,block_kv` from environment variable `name` (tuning runs), if set and
/// valid.
pub(crate) fn shape_override(name: &str) -> Option<(usize, usize, usize)> {
    let text = std::env::var(name).ok()?;
    let parts: Vec<usize> = text
        .split(',')
        .filter_map(|p| p.trim().parse().ok())
        .collect();
    match parts[..] {
        [planes, rows, kv]
            if matches!(planes, 1 | 2 | 4 | 8)
                && matches!(rows, 16 | 32)
                && matches!(kv, 16 | 32 | 64 | 128) =>
        {
            Some((planes, rows, kv))
        }
        _ => {
            log::warn!("ignoring {name}={text:?}: expected planes,rows,kv");
            None
        }
    }
}

/// Block shapes of the tensor-core forward. Up to head dim 128: 4 planes of 32 query rows
/// (128-row query blocks) over 64-key stages, the shape measured fastest on the H100 at head
/// dims 64 and 128 (`docs/perf-notes.md`). Wider heads: 8 planes of 16 rows, so that each unit's
/// output accumulators (16 rows × the value dim per plane) stay at 128 registers.
/// `BURN_FLASH_TC_SHAPE=planes,plane_rows,block_kv` overrides them for tuning runs.
fn tensor_core_config(head_dim: usize, value_dim: usize) -> TileConfig {
    static OVERRIDE: OnceLock<Option<(usize, usize, usize)>> = OnceLock::new();
    let shape = OVERRIDE.get_or_init(|| shape_override("BURN_FLASH_TC_SHAPE"));
    let default = if head_dim.max(value_dim) > 128 {
        (8, 16, 64)
    } else {
        (4, 32, 64)
    };
    let (planes, plane_rows, block_kv) = shape.unwrap_or(default);
    TileConfig::tensor_core(head_dim, value_dim, planes, plane_rows, block_kv)
}

/// Run the fused forward. `q: [b, h, sq, d]`, `k: [b, hkv, sk, d]`, `v: [b, hkv, sk, dv]` (`h`
/// a multiple of `hkv`), on one device with one dtype, accepted by [`support`]; the optional
/// boolean `mask` (`true` hides) and additive `bias` (the inputs' dtype) are
/// `[b|1, h|1, sq|1, sk]`. Returns the output `[b, h, sq, dv]` in the input dtype and the
/// log-sum-exp `[b, h, sq]` in f32 (natural log of Σ exp(scale·s + bias) over the visible keys,
/// `s` softcapped; `-inf` for rows that see no key, whose output is 0).
pub fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    inputs: ScoreInputs<R>,
    params: ScoreParams,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let params = params.with_inputs(inputs.mask_dims(), inputs.bias.is_some());
    let dims = q.meta.shape().clone();
    let (batch, heads, seq_q, head_dim) = (dims[0], dims[1], dims[2], dims[3]);
    let value_dim = v.meta.shape()[3];
    let client = q.client.clone();

    let tile = support(&client, q.dtype, head_dim, value_dim)
        .unwrap_or_else(|reason| panic!("fused attention launched on unsupported input: {reason}"));
    let out = output(&q, Shape::new([batch, heads, seq_q, value_dim]), q.dtype);
    let lse = output(&q, Shape::new([batch, heads, seq_q]), DType::F32);
    if out.meta.num_elements() == 0 {
        return (out, lse);
    }

    let cfg = forward_config(tile, head_dim, value_dim)
        .with_scores(&params)
        .with_bounded_max(params.softcap, matches!(q.dtype, DType::BF16 | DType::F32));
    let (cfg, inputs, hidden_blocks) = stage_inputs(&client, cfg, inputs, q.dtype);
    let cfg = match cfg.staged.bias {
        Some(_) => cfg.with_staged(Staged {
            bias_add: bias_add(params.scale, q.dtype),
            ..cfg.staged
        }),
        None => cfg,
    };
    let cfg = cfg.with_batch_inner(batch_inner(&inputs, batch));
    let forward_bytes = |cfg: &TileConfig| cfg.shared_bytes(q.dtype.size());
    let cfg = if tma_staging(&client, &cfg, &[&k, &v], forward_bytes) {
        crate::testing::record_tma_launch();
        cfg.with_tma()
    } else {
        cfg
    };
    let (k_map, v_map) = (stage_map(&k, &cfg), stage_map(&v, &cfg));
    let cube_dim = cube_dim(&cfg);
    let cube_count = cube_count(&cfg, seq_q, heads, batch);
    // The score inputs can be the largest tensors of the launch (`[b, h, sq, sk]`).
    let address = address_type(&[&q, &k, &v, &out])
        .max(inputs.address_type())
        .max(address_type(&hidden_blocks.iter().collect::<Vec<_>>()));
    let dtypes = [q.dtype.into(), inputs.mask_dtype()];
    let (seed_lo, seed_hi, threshold) = params.dropout_args();

    // SAFETY: shapes and strides were validated by the caller; every index the kernel forms is
    // bounded by the tensors' shapes, and out-of-range rows are clamped or zero-filled.
    unsafe {
        match tile {
            TilePath::TensorCore => flash_forward::launch_unchecked::<MmaTile, R>(
                &client,
                cube_count,
                cube_dim,
                address,
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                k_map.into(),
                v_map.into(),
                inputs.mask_arg().into(),
                hidden_blocks
                    .clone()
                    .map(CubeTensor::into_tensor_arg)
                    .into(),
                inputs.bias_arg().into(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                params.scale,
                params.left,
                params.right,
                params.softcap.unwrap_or(1.0),
                f32::NEG_INFINITY,
                seed_lo,
                seed_hi,
                threshold,
                params.alibi_pow2.unwrap_or(1),
                cfg,
                dtypes,
            ),
            TilePath::Portable => flash_forward::launch_unchecked::<PortableTile, R>(
                &client,
                cube_count,
                cube_dim,
                address,
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                None.into(),
                None.into(),
                inputs.mask_arg().into(),
                hidden_blocks
                    .clone()
                    .map(CubeTensor::into_tensor_arg)
                    .into(),
                inputs.bias_arg().into(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                params.scale,
                params.left,
                params.right,
                params.softcap.unwrap_or(1.0),
                f32::NEG_INFINITY,
                seed_lo,
                seed_hi,
                threshold,
                params.alibi_pow2.unwrap_or(1),
                cfg,
                dtypes,
            ),
        }
    }
    (out, lse)
}

/// Whether a launch with blocks `cfg` stages `staged` (the tensors its stages copy: K and V in
/// the forward, Q and dO in the dK/dV launch) by tensor maps ([`TileConfig::tma`]): the runtime
/// has the copy engine (CUDA from SM90), the blocks allow it, each tensor's start and strides
/// are whole 16-byte units, as a tensor map needs, and the cube's shared memory
/// (`shared_bytes`) still fits with the stages' 1024-byte alignment. Otherwise every unit
/// issues its 16-byte copies, as while a [`avoid_tma`](crate::testing::avoid_tma) guard lives
/// or with `BURN_FLASH_TMA=0` (tuning runs).
pub(crate) fn tma_staging<R: CubeRuntime>(
    client: &ComputeClient<R>,
    cfg: &TileConfig,
    staged: &[&CubeTensor<R>],
    shared_bytes: impl Fn(&TileConfig) -> usize,
) -> bool {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    let wanted = OVERRIDE
        .get_or_init(|| flag_override("BURN_FLASH_TMA"))
        .unwrap_or(true);
    let aligned = |t: &&CubeTensor<R>| {
        let size = t.dtype.size();
        let strides = t.meta.strides();
        t.handle.offset_start.unwrap_or(0).is_multiple_of(16)
            && strides[strides.len() - 1] == 1
            && strides
                .iter()
                .all(|s| (s * size).is_multiple_of(16) || *s == 1)
    };
    wanted
        && !crate::testing::tma_avoided()
        && client.properties().features.tma.contains(Tma::Base)
        && cfg.can_stage_by_tma()
        && staged.iter().all(aligned)
        && fits_shared(client, "tensor-map staged", shared_bytes(&cfg.with_tma())).is_ok()
}

/// With `cfg.tma`, a tensor map of `t` (`[b, h, seq, cfg.head_dim]`) whose box is one stage's
/// rows (`cfg.block_kv`) by 64 columns, one 128-byte line each, with the 128-byte swizzle the
/// stages are read with: one box per stage at head dim 64, one per panel of 64 columns wider
/// ([`TileConfig::staged_pitch`]).
pub(crate) fn stage_map<R: CubeRuntime>(
    t: &CubeTensor<R>,
    cfg: &TileConfig,
) -> Option<TensorMapArg<R, Tiled>> {
    cfg.tma.then(|| {
        let tile = Shape::new([1, 1, cfg.block_kv, 8 * CHUNK]);
        let elem: StorageType = t.dtype.into();
        TensorMapArg::new(TiledArgs::new(tile), t.clone().into_tensor_arg(), elem)
            .with_swizzle(TensorMapSwizzle::B128)
    })
}

/// `cfg` with the score inputs it stages, and the inputs as the forward reads them: a per-pair
/// mask packed into bits ([`pack`](super::pack)) where the tensor-core forward stages it, with
/// the blocks it hides wholly.
fn stage_inputs<R: CubeRuntime>(
    client: &ComputeClient<R>,
    cfg: TileConfig,
    inputs: ScoreInputs<R>,
    dtype: DType,
) -> (TileConfig, ScoreInputs<R>, Option<CubeTensor<R>>) {
    let packs = cfg.tile == TilePath::TensorCore
        && cfg.mask.tensor
        && !cfg.mask.per_key
        && cfg.block_kv.is_multiple_of(32);
    if packs {
        let packed_cfg = cfg.with_packed_mask(true);
        let staged = staging(client, &packed_cfg, &inputs, dtype);
        if staged.mask.is_some() {
            let packed = inputs
                .mask
                .as_ref()
                .map(|mask| pack_mask(mask, cfg.block_q, cfg.block_kv));
            let (mask, hidden_blocks) = packed
                .map(|packed| (packed.words, packed.hidden_blocks))
                .unzip();
            let inputs = ScoreInputs { mask, ..inputs };
            return (packed_cfg.with_staged(staged), inputs, hidden_blocks);
        }
    }
    let staged = staging(client, &cfg, &inputs, dtype);
    (cfg.with_staged(staged), inputs, None)
}

/// The score inputs the tensor-core forward stages in shared memory ([`Staged`]): a packed mask
/// (always whole 16-byte chunks), an unpacked mask and a bias whose rows are whole 16-byte chunks
/// (`seq_k` a multiple of the chunk: every stride of a contiguous input is a multiple of
/// `seq_k`, and buffers start aligned), a bias only where a block's row fills whole 128-byte
/// lines (its `ldmatrix` swizzle), as many of them as the device's shared memory holds beside
/// the K/V stages (the mask first, the smaller). The others are read in place. The bias gets one
/// stage instead of two where that keeps more cubes per SM (head dim 128 on an H100).
/// `BURN_FLASH_STAGE_INPUTS=0` reads both in place (tuning runs).
fn staging<R: CubeRuntime>(
    client: &ComputeClient<R>,
    cfg: &TileConfig,
    inputs: &ScoreInputs<R>,
    dtype: DType,
) -> Staged {
    static DISABLED: OnceLock<bool> = OnceLock::new();
    let disabled =
        DISABLED.get_or_init(|| std::env::var("BURN_FLASH_STAGE_INPUTS").is_ok_and(|v| v == "0"));
    if cfg.tile != TilePath::TensorCore || *disabled {
        return Staged::default();
    }
    let chunk = |input: &Option<CubeTensor<R>>| {
        let input = input.as_ref()?;
        let chunk = 16 / input.dtype.size();
        let seq_k = input.meta.shape()[3];
        (seq_k.is_multiple_of(chunk) && cfg.block_kv.is_multiple_of(chunk)).then_some(chunk)
    };
    let mask = if cfg.mask.packed {
        inputs.mask.as_ref().map(|_| 16 / DType::U32.size())
    } else {
        chunk(&inputs.mask)
    };
    let bias = chunk(&inputs.bias).filter(|&chunk| (cfg.block_kv / chunk).is_multiple_of(8));
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
    .find(|&staged| fits_shared(client, "forward", bytes(staged)).is_ok())
    .unwrap_or_default();
    if staged.bias.is_none() {
        return staged;
    }
    let single = Staged {
        bias_single: true,
        ..staged
    };
    let prefer_single = match bias_stages_override() {
        Some(stages) => stages == 1,
        None => cubes_per_sm(client, bytes(single)) > cubes_per_sm(client, bytes(staged)),
    };
    if prefer_single { single } else { staged }
}

/// How the tensor-core forward adds a staged bias ([`BiasAdd`]): bf16 by the tensor cores where
/// bf16 holds `1 / scale` exactly (head dims 16, 64 and 256 at the default scale) and that
/// factor exceeds 1.004 (so that the lowest finite bf16 times it overflows to the `-inf` it
/// stands for); else converted per score. `BURN_FLASH_BIAS_MMA=0` converts always (tuning
/// runs).
fn bias_add(scale: f32, dtype: DType) -> BiasAdd {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    let factor = 1.0 / scale;
    let exact = half::bf16::from_f32(factor).to_f32() == factor;
    let overflows = (half::bf16::MIN.to_f32() * factor).is_infinite();
    let forced_off = *OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_BIAS_MMA")) == Some(false);
    if dtype == DType::BF16 && exact && overflows && !forced_off {
        BiasAdd::Mma
    } else {
        BiasAdd::Convert
    }
}

/// Cubes of the tensor-core forward an SM holds with `bytes` of shared memory each: an SM has
/// 1 KiB more than one cube may use and reserves 1 KiB per cube, and at up to 255 registers
/// for each of a cube's 128 units the register file holds two.
fn cubes_per_sm<R: CubeRuntime>(client: &ComputeClient<R>, bytes: usize) -> usize {
    let per_sm = client.properties().hardware.max_shared_memory_size + 1024;
    (per_sm / (bytes + 1024)).min(2)
}

/// `BURN_FLASH_BIAS_STAGES=1|2`: the staged bias's stages for tuning runs, whatever keeps more
/// cubes per SM.
fn bias_stages_override() -> Option<usize> {
    static OVERRIDE: OnceLock<Option<usize>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| {
        let text = std::env::var("BURN_FLASH_BIAS_STAGES").ok()?;
        let stages = text.trim().parse().ok().filter(|s| matches!(s, 1 | 2));
        if stages.is_none() {
            log::warn!("ignoring BURN_FLASH_BIAS_STAGES={text:?}: expected 1 or 2");
        }
        stages
    })
}

/// The mask and bias inputs of a launch, contiguous, the mask's booleans as integers.
#[derive(Clone, Debug)]
pub struct ScoreInputs<R: CubeRuntime> {
    /// `[b|1, h|1, sq|1, sk]`, `true` (bit 0 set) hides the pair.
    pub mask: Option<CubeTensor<R>>,
    /// `[b|1, h|1, sq|1, sk]`, in the inputs' dtype.
    pub bias: Option<CubeTensor<R>>,
}

impl<R: CubeRuntime> ScoreInputs<R> {
    /// These inputs as broadcasts ([`broadcast_view`]), made contiguous; a mask stored as native
    /// booleans becomes u8.
    pub fn new(mask: Option<CubeTensor<R>>, bias: Option<CubeTensor<R>>) -> Self {
        let mask = mask.map(broadcast_view).map(|mask| match mask.dtype {
            DType::Bool(BoolStore::Native) => bool_cast(mask, DType::U8),
            _ => mask,
        });
        Self {
            mask,
            bias: bias.map(broadcast_view),
        }
    }

    /// The mask's dims, if there is one.
    pub(crate) fn mask_dims(&self) -> Option<&[usize]> {
        self.mask.as_ref().map(|mask| &mask.meta.shape()[..])
    }

    /// The integer type the kernels read the mask as (u8 when there is none).
    pub(crate) fn mask_dtype(&self) -> StorageType {
        self.mask
            .as_ref()
            .map_or(DType::U8, |mask| mask.dtype)
            .into()
    }

    /// The address width the kernels need to index the mask and bias.
    pub(crate) fn address_type(&self) -> AddressType {
        address_type(&self.mask.iter().chain(&self.bias).collect::<Vec<_>>())
    }

    pub(crate) fn mask_arg(&self) -> Option<TensorArg<R>> {
        self.mask.clone().map(CubeTensor::into_tensor_arg)
    }

    pub(crate) fn bias_arg(&self) -> Option<TensorArg<R>> {
        self.bias.clone().map(CubeTensor::into_tensor_arg)
    }
}

/// `input` (`[b, h, sq, sk]`) read as the broadcast it is: a batch, head or query dim expanded
/// with stride 0 (as `Tensor::expand` leaves one) gets size 1, which every kernel broadcasts,
/// rather than being copied out to its full size; what is then still not contiguous is copied.
fn broadcast_view<R: CubeRuntime>(mut input: CubeTensor<R>) -> CubeTensor<R> {
    for dim in 0..3 {
        if input.meta.strides()[dim] == 0 {
            input.meta.shape_mut()[dim] = 1;
        }
    }
    // A dim of size 1 is never stepped over: give it the stride a contiguous tensor has, which
    // is what `into_contiguous` checks.
    let mut stride = 1;
    for dim in (0..input.meta.num_dims()).rev() {
        let size = input.meta.shape()[dim];
        if size == 1 {
            input.meta.strides_mut()[dim] = stride;
        }
        stride *= size;
    }
    into_contiguous(input)
}

/// Units of a cube: one plane per `cfg.planes` (tensor cores), one unit per owned row (portable).
pub(crate) fn cube_dim(cfg: &TileConfig) -> CubeDim {
    match cfg.tile {
        TilePath::TensorCore => CubeDim::new_2d(32, cfg.planes as u32),
        TilePath::Portable => CubeDim::new_1d(cfg.units() as u32),
    }
}

/// A contiguous output, filled with NaN first when tests asked for poisoned outputs.
pub(crate) fn output<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    let tensor =
        empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype);
    if crate::testing::poison_enabled() && tensor.meta.num_elements() > 0 {
        poison(&tensor);
    }
    tensor
}

/// `value` is a runtime argument: WGSL has no literal for NaN.
#[cube(launch_unchecked, address_type = "dynamic")]
fn fill<F: Float, N: Size>(
    tensor: &mut Tensor<Vector<F, N>>,
    value: f32,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS < tensor.len() {
        tensor[ABSOLUTE_POS] = Vector::new(F::cast_from(value));
    }
}

fn poison<R: CubeRuntime>(tensor: &CubeTensor<R>) {
    fill_tensor(tensor, f32::NAN);
}

/// The widest vector the client moves in one access that divides the last dim of each of
/// `tensors` and all their other strides (1 when none does).
pub(crate) fn vector_width<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> usize {
    tensors
        .iter()
        .map(|t| {
            tensor_vector_size_parallel(
                t.client.io_optimized_vector_sizes(t.dtype.size()),
                t.meta.shape(),
                t.meta.strides(),
                t.meta.num_dims() - 1,
            )
        })
        .min()
        .unwrap_or(1)
}

/// The address width every index into `tensors` fits (32 bits unless one is too large).
pub(crate) fn address_type<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> AddressType {
    tensors
        .iter()
        .map(|t| t.required_address_type())
        .max()
        .unwrap_or_default()
}

/// Set every element of a contiguous tensor to `value`, a vector per unit.
pub(crate) fn fill_tensor<R: CubeRuntime>(tensor: &CubeTensor<R>, value: f32) {
    let width = vector_width(&[tensor]);
    let units = tensor.meta.num_elements() / width;
    if units == 0 {
        return;
    }
    let cube_dim = CubeDim::new(&tensor.client, units);
    let cube_count = cubecl::calculate_cube_count_elemwise(&tensor.client, units, cube_dim);
    // SAFETY: one unit per vector, guarded by the tensor length (in vectors).
    unsafe {
        fill::launch_unchecked(
            &tensor.client,
            cube_count,
            cube_dim,
            tensor.required_address_type(),
            width,
            tensor.clone().into_tensor_arg(),
            value,
            tensor.dtype.into(),
        );
    }
}

#[cfg(test)]
mod tests {
    //! Kernel-level smoke test on the bare wgpu backend (lavapipe in CI): the portable tile
    //! against a plain CPU computation. The public API is tested at the workspace root.
    use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};
    use burn_cubecl::CubeBackend;

    type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        sq: usize,
        sk: usize,
        d: usize,
        causal: bool,
    ) -> Vec<f64> {
        let scale = 1.0 / (d as f64).sqrt();
        let mut out = vec![0.0; sq * d];
        for i in 0..sq {
            let visible = |j: usize| !causal || j + sq <= i + sk;
            let s: Vec<f64> = (0..sk)
                .map(|j| {
                    (0..d)
                        .map(|c| q[i * d + c] as f64 * k[j * d + c] as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = (0..sk)
                .filter(|&j| visible(j))
                .map(|j| s[j])
                .fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = (0..sk)
                .map(|j| if visible(j) { (s[j] - m).exp() } else { 0.0 })
                .collect();
            let l: f64 = p.iter().sum();
            for c in 0..d {
                out[i * d + c] = if l > 0.0 {
                    (0..sk).map(|j| p[j] * v[j * d + c] as f64).sum::<f64>() / l
                } else {
                    0.0
                };
            }
        }
        out
    }

    #[test]
    fn portable_forward_matches_cpu() {
        let device = WgpuDevice::default();
        crate::testing::poison_outputs(true);
        for &(sq, sk, d, causal) in &[
            (1, 1, 64, false),
            (1, 2, 64, false),
            (2, 2, 64, false),
            (7, 7, 64, false),
            (65, 33, 64, true),
            (33, 70, 128, true),
        ] {
            let q = Tensor::<B, 4>::random([1, 1, sq, d], Distribution::Normal(0.0, 1.0), &device);
            let k = Tensor::<B, 4>::random([1, 1, sk, d], Distribution::Normal(0.0, 1.0), &device);
            let v = Tensor::<B, 4>::random([1, 1, sk, d], Distribution::Normal(0.0, 1.0), &device);
            let data = |t: &Tensor<B, 4>| t.to_data().to_vec::<f32>().unwrap();
            let expected = reference(&data(&q), &data(&k), &data(&v), sq, sk, d, causal);
            let options = crate::FlashAttentionOptions::new().with_causal(causal);
            let (out, _lse) = super::forward(
                q.into_primitive().tensor(),
                k.into_primitive().tensor(),
                v.into_primitive().tensor(),
                super::ScoreInputs::new(None, None),
                crate::kernel::ScoreParams::new(&options, 1, d, sq, sk),
            );
            let out = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out));
            let got = out.to_data().to_vec::<f32>().unwrap();
            let err = got
                .iter()
                .zip(&expected)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(
                err < 1e-4,
                "sq {sq} sk {sk} d {d} causal {causal}: max error {err}"
            );
        }
    }

    /// Expanded views keep their storage: a stride-0 dim becomes a broadcast dim, the values
    /// read through it are those of the expanded tensor, and other views are copied.
    #[test]
    fn score_inputs_read_expanded_views_as_broadcasts() {
        let device = WgpuDevice::default();
        let source = Tensor::<B, 4>::random([1, 2, 1, 5], Distribution::Uniform(0.0, 1.0), &device);
        let expanded = source.clone().expand([3, 2, 4, 5]);
        let mask = source
            .clone()
            .lower_elem(0.5)
            .expand([3, 2, 4, 5])
            .into_primitive();
        let bias = expanded.clone().into_primitive().tensor();
        let storage = format!("{:?}", bias.handle.memory);
        let inputs = super::ScoreInputs::new(Some(mask), Some(bias));

        let bias = inputs.bias.unwrap();
        assert_eq!(bias.meta.shape()[..], [1, 2, 1, 5]);
        assert_eq!(format!("{:?}", bias.handle.memory), storage, "copied");
        let read = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(bias));
        assert_eq!(read.expand([3, 2, 4, 5]).to_data(), expanded.to_data());
        let mask = inputs.mask.unwrap();
        assert_eq!(mask.meta.shape()[..], [1, 2, 1, 5]);
        assert!(mask.is_contiguous());

        // A transposed view has no stride 0: copied, dims kept.
        let transposed = source.expand([3, 2, 4, 5]).swap_dims(2, 3);
        let bias =
            super::ScoreInputs::new(None, Some(transposed.clone().into_primitive().tensor()))
                .bias
                .unwrap();
        assert!(bias.is_contiguous());
        assert_eq!(bias.meta.shape()[..], [1, 2, 5, 4]);
    }
}
