//! Compile-time configuration of the kernels: block shapes, plane layout, and the register layout
//! each tile uses. Every kernel specialises on one [`TileConfig`] (the backward also on which side
//! it owns); nothing else is comptime.
//!
//! A cube *owns* `block_q` rows of one operand, held by its units for the whole launch, and walks
//! blocks of `block_kv` rows of the other operand *staged* in shared memory. In the forward and in
//! the dQ launch the owned rows are queries and the staged ones keys/values; the dK/dV launch owns
//! keys and stages queries.

use std::hash::{Hash, Hasher};

/// Rows of one MMA tile (m16n8k16).
pub const MMA_M: usize = 16;
/// Columns of one MMA accumulator tile (m16n8k16).
pub const MMA_N: usize = 8;
/// Reduction depth of one MMA (m16n8k16).
pub const MMA_K: usize = 16;
/// Elements in one 16-byte shared-memory chunk of a 16-bit type: the unit of async copies,
/// of `ldmatrix` rows and of the swizzle.
pub const CHUNK: usize = 8;
/// Byte alignment of every shared-memory buffer the tensor-core kernels stage 16-byte chunks in.
/// CubeCL places a kernel's shared memories in hash-set order, one process's layout differing
/// from the next; at 16-byte alignment a stage could start 16 bytes past a 128-byte line, and the
/// head dim 128 forward then ran up to 12 % slower in that process (`docs/perf-notes.md`,
/// 2026-11-26, e05353a). 128 makes every layout line-aligned.
pub const SMEM_ALIGN: usize = 128;
/// Byte alignment of the stages a tensor map fills ([`TileConfig::tma`]): its 128-byte swizzle
/// takes a row's key from the address bits above the 128-byte line, so a stage must start on a
/// 1024-byte boundary for that key to be the row's index mod 8, as [`stage_offset`] reads it.
///
/// [`stage_offset`]: super::stage::stage_offset
pub const TMA_ALIGN: usize = 1024;

/// The widest range, in powers of two, that probabilities may span below 1 when the forward
/// subtracts a fixed bound instead of the row max ([`TileConfig::with_bounded_max`]): at least
/// 2⁻⁹⁶, which leaves 30 binades above f32's smallest normal for the products with the values
/// (a softcap up to 33.27).
pub const BOUNDED_MAX_RANGE: f32 = 96.0;

/// Which matrix tile a fused launch uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TilePath {
    /// Tensor cores: `MmaDefinition` m16n8k16 tiles (`ldmatrix` + `mma.sync`), f16/bf16 inputs
    /// with f32 accumulation, K/V staged by asynchronous copies (by tensor maps at head dims 64
    /// and 128 from SM90). CUDA, SM80 and newer.
    TensorCore,
    /// Portable register FMAs in f32, one unit per query row; any CubeCL runtime.
    Portable,
}

/// Where the 16-byte chunks of a swizzled block lie: `row` elements between consecutive rows
/// and `group` between a row's consecutive groups of eight chunks (128 bytes). Within a group,
/// chunk `c` of row `r` sits at `c ^ (r % 8)` either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pitch {
    pub row: usize,
    pub group: usize,
}

impl Pitch {
    /// Whole rows one after another, `width` elements apart
    /// ([`stage_offset`](super::stage::stage_offset)'s layout).
    pub fn rows(width: usize) -> Self {
        Self {
            row: width,
            group: 8 * CHUNK,
        }
    }

    /// Each 128-byte group of columns of `rows` rows as a panel of its own, rows 128 bytes
    /// apart: what a tensor map's box of 64 16-bit columns with the 128-byte swizzle writes, one
    /// box per panel.
    pub fn panels(rows: usize) -> Self {
        Self {
            row: 8 * CHUNK,
            group: rows * 8 * CHUNK,
        }
    }
}

/// Block shapes and layout of one launch.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct TileConfig {
    /// Which matrix tile computes the two products.
    pub tile: TilePath,
    /// Width of the owned rows and of the staged rows they multiply in the score product
    /// (the head dim of queries and keys).
    pub head_dim: usize,
    /// Width of the staged rows of the second product and of its accumulators (the head dim of
    /// values).
    pub value_dim: usize,
    /// Owned rows per cube (queries in the forward).
    pub block_q: usize,
    /// Staged rows per shared-memory stage (keys and values in the forward).
    pub block_kv: usize,
    /// Planes per cube (tensor-core tile); the portable tile uses one unit per query row.
    pub planes: usize,
    /// Query rows each plane owns (tensor-core tile, a multiple of [`MMA_M`]). Two m16 blocks
    /// per plane read every K/V fragment from shared memory once for 32 rows, halving the
    /// shared-memory traffic per MMA compared with one.
    pub plane_rows: usize,
    /// Planes that share one group of `plane_rows` owned rows (tensor-core dK/dV launch; 1
    /// elsewhere). Plane `p` of a group computes the scores of its `1 / split` of each staged
    /// block's columns, the group exchanges them through shared memory, and the plane then
    /// accumulates part `p` of the accumulators' columns over the whole block. Two m16 blocks
    /// per plane then fit beside two head-dim-wide accumulators, so every staged fragment feeds
    /// two products.
    pub split: usize,
    /// Keep the owned operands in shared memory at every head dim
    /// ([`with_owned_in_smem`](Self::with_owned_in_smem), [`query_in_smem`](Self::query_in_smem)).
    pub owned_in_smem: bool,
    /// Which keys are hidden: band bounds (causal, sliding window), a boolean mask input.
    pub mask: MaskConfig,
    /// An additive bias input is added to the scores.
    pub bias: bool,
    /// The dQ launch writes the bias gradient (the scores' gradient, `[b, h, seq_q, seq_k]`).
    pub bias_grad: bool,
    /// Scores pass through `softcap · tanh(s / softcap)` before the softmax.
    pub softcap: bool,
    /// The forward's softmax subtracts the softcap's bound instead of a running row max
    /// ([`with_bounded_max`](Self::with_bounded_max)).
    pub bounded_max: bool,
    /// Probabilities are dropped and the kept ones rescaled ([`dropout`](super::dropout)).
    pub dropout: bool,
    /// ALiBi's bias is added to the scores ([`alibi_slope`](super::inputs::alibi_slope)).
    pub alibi: bool,
    /// The dK/dV launch also adds each staged query block's dQ with f32 atomics (and needs a
    /// `block_q × block_kv` scratch tile on the tensor-core tile to transpose dS, which a split
    /// shares with its exchange).
    pub atomic_dq: bool,
    /// The staged blocks (K and V in the forward, Q and dO in the dK/dV launch) arrive by the
    /// tensor memory accelerator (SM90 and newer): one unit issues a tile copy per operand and
    /// stage, which the copy engine swizzles and zero-fills past the sequence, instead of every
    /// unit forming the addresses and bound tests of its 16-byte copies
    /// ([`can_stage_by_tma`](Self::can_stage_by_tma)).
    pub tma: bool,
    /// Which score inputs the tensor-core forward stages in shared memory.
    pub staged: Staged,
    /// The grid steps through batches before heads ([`grid`](super::grid)).
    pub batch_inner: bool,
    /// Which cubes of a dK/dV launch whose last wave is split walk what
    /// ([`tail`](super::backward::tail)).
    pub tail: TailPart,
    /// The forward splits each row block's keys across cubes (split-KV, for short query blocks
    /// such as decoding's): the grid's x runs over (row block, split), and each cube writes the
    /// partial output and log-sum-exp of its share of the key blocks as head
    /// `split · heads + head` of its outputs, which [`combine`](super::forward::combine) merges.
    pub kv_split: Switch,
    /// The forward reads each sequence's key length from an input (`[b]`: a cache's filled
    /// parts of different lengths), which ends its band ([`Band::of_sequence`](super::band::Band)).
    pub key_lengths: Switch,
    /// The forward reads keys and values from the pages a block table maps each sequence's key
    /// blocks to ([`pages`](super::forward::pages)).
    pub paged: Switch,
    /// The forward reads packed sequences of different lengths: one `[1, heads, total, dim]`
    /// tensor per operand, each sequence's rows found by its starts
    /// ([`Band::of_packed`](super::band::Band)); the grid's batch runs over the sequences.
    pub varlen: Switch,
    /// The tensor-core forward stages keys and values in three shared-memory stages, two blocks
    /// in flight while one is computed, instead of two ([`kv_stages`](Self::kv_stages)).
    pub three_kv_stages: Switch,
}

/// A comptime switch that joins a configuration's hash only when on. CubeCL names each kernel's
/// entry point by that hash, and compiled shaders are cached under the name (lavapipe's cache
/// is what keeps CI's tests short): a switch added to a configuration after its kernels existed
/// leaves them their names while off, as CubeCL leaves an unset debug level out of the same
/// hash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Switch(pub bool);

impl Hash for Switch {
    fn hash<H: Hasher>(&self, state: &mut H) {
        if self.0 {
            self.0.hash(state);
        }
    }
}

/// The part a dK/dV launch takes of a grid whose last wave's cubes are split into pieces
/// ([`tail`](super::backward::tail)).
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum TailPart {
    /// No split: every cube walks its block whole.
    #[default]
    All,
    /// The grid's first cubes walk whole; those from the split on exit at once.
    Whole,
    /// A grid of (piece, split cube): each cube walks one piece and leaves partial sums.
    Pieces,
}

/// Score inputs (a mask, a bias) the tensor-core forward stages in shared memory: each KV
/// block's block of them (`block_q × block_kv`; one row of keys for a mask the same for every
/// query) is copied asynchronously beside its keys and values, so the units read it from shared
/// memory, its latency hidden behind the previous block's math, instead of waiting on global
/// memory where each score register sits (the bias with `ldmatrix`, straight into the score
/// layout). Each is the input's elements per 16-byte chunk when staged.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub struct Staged {
    pub mask: Option<usize>,
    pub bias: Option<usize>,
    /// The bias has one stage, filled at the start of the iteration that reads it (the copy
    /// overlaps that block's score product) instead of a block ahead: 16 KiB less per cube,
    /// which keeps two cubes per SM where two stages would leave one.
    pub bias_single: bool,
    /// How a staged bias block reaches the scores ([`BiasAdd`]).
    pub bias_add: BiasAdd,
}

/// How the tensor-core forward adds `bias / scale` from a staged bias block to the raw scores.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum BiasAdd {
    /// Each score register converts its bias element to f32 and adds it times `1 / scale`:
    /// two instructions per score.
    #[default]
    Convert,
    /// The tensor cores add it: a 16 × 16 block of the bias as the A operand times a B operand
    /// holding `1 / scale` on a diagonal lands on the accumulators of one n-tile of the
    /// scores, one MMA per n-tile and m16 block instead of two instructions per score. Only
    /// where the input dtype holds `1 / scale` exactly (`docs/perf-notes.md`, 2026-11-26,
    /// 3c20369: a factor in two parts, two MMAs per n-tile, measured slower than converting).
    Mma,
}

impl Staged {
    /// Stages of the staged bias.
    pub fn bias_stages(&self) -> usize {
        if self.bias_single { 1 } else { 2 }
    }

    /// Whether the tensor cores add the staged bias ([`BiasAdd::Mma`]).
    pub fn bias_mma(&self) -> bool {
        self.bias_add == BiasAdd::Mma
    }
}

/// The Hopper forward's blocks ([`warpgroup`](super::forward::warpgroup)): warpgroups of 64
/// query rows each, 128-key stages of K and V double-buffered by tensor maps, the 128-byte
/// swizzle, panels of 64 columns.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct WarpgroupConfig {
    /// Width of queries, keys and values (64 or 128).
    pub head_dim: usize,
    /// Warpgroups computing, 64 query rows each.
    pub warpgroups: usize,
    /// Keys right of a diagonal are hidden (causal, a window's right side).
    pub causal: bool,
    /// The inputs are bf16 (else f16).
    pub bf16: bool,
    /// Each cube walks query blocks in a loop (one cube an SM), the next block's queries and
    /// first keys copied while the current one finishes; else one cube a query block.
    pub persistent: bool,
    /// A boolean mask input, packed into bits for blocks of [`block_q`](Self::block_q) rows
    /// and [`BLOCK_KV`](Self::BLOCK_KV) keys ([`pack`](super::pack)), hides keys: each query
    /// block walks only the key blocks from the first its mask lets it see to the last.
    pub mask: Switch,
    /// The mask has one row of keys for every query (key padding, `[b|1, h|1, 1, sk]`): packed
    /// as that one row, its words and wholly hidden blocks are read at row 0 for every query
    /// block.
    pub key_mask: bool,
    /// An additive bias input (`[b|1, h|1, sq, sk]`, the inputs' dtype, rows of whole 16
    /// bytes) is added to the scores: the producer copies each key block's bias for the query
    /// block with its keys and values (a tensor map's boxes, as the queries'), into two stages
    /// of their own.
    pub bias: Switch,
    /// Whether the bias has a batch and a head dim of its own (else one batch or head is
    /// read for every batch or head).
    pub bias_steps: (bool, bool),
    /// Batches before heads in the cubes' order, so that the cubes running at once read one
    /// head's bias shared by the batch ([`grid::batch_inner`](super::grid::batch_inner)).
    pub batch_inner: bool,
    /// Dropout zeroes the probabilities its generator ([`dropout`](super::dropout)) drops
    /// before the values' product, after the softmax statistics saw them.
    pub dropout: Switch,
}

impl WarpgroupConfig {
    /// Keys per stage: the first product's `n`, the second's reduced dim.
    pub const BLOCK_KV: usize = 128;

    /// The blocks at this head dim: three warpgroups at 64 (192-row query blocks; with the
    /// producer's warp and its registers, one cube fills an SM), two at 128, whose stages take
    /// twice the shared memory and whose accumulators twice the registers.
    pub fn new(head_dim: usize, causal: bool, bf16: bool) -> Self {
        Self {
            head_dim,
            warpgroups: if head_dim <= 64 { 3 } else { 2 },
            causal,
            bf16,
            persistent: false,
            mask: Switch(false),
            key_mask: false,
            bias: Switch(false),
            bias_steps: (false, false),
            batch_inner: false,
            dropout: Switch(false),
        }
    }

    /// Query blocks a cube holds at once: two where it walks them in a loop (the next one's
    /// copy in flight), else one.
    pub fn query_slots(&self) -> usize {
        if self.persistent { 2 } else { 1 }
    }

    /// Query rows per cube.
    pub fn block_q(&self) -> usize {
        64 * self.warpgroups
    }

    /// Shared memory of one cube for 16-bit inputs: its query blocks, two stages of K and V and
    /// with a bias two of its blocks, each a whole number of 1024-byte swizzle periods laid
    /// out from a 1024-byte boundary, plus their barriers (and a period of slack).
    pub fn shared_bytes(&self) -> usize {
        let rows = self.query_slots() * self.block_q() + 4 * Self::BLOCK_KV;
        (rows * self.head_dim + 2 * self.bias_stage_len()) * 2 + TMA_ALIGN + 64
    }

    /// Query rows the mask is packed for ([`pack`](super::pack)): a query block's, or with
    /// [`key_mask`](Self::key_mask) its one row.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn mask_rows(&self) -> usize {
        if self.key_mask { 1 } else { self.block_q() }
    }

    /// Elements of one bias stage: the query block's rows over a key block's keys (none
    /// without a bias).
    pub fn bias_stage_len(&self) -> usize {
        if self.bias.0 {
            self.block_q() * Self::BLOCK_KV
        } else {
            0
        }
    }
}

/// The blocks of the backward on Hopper's warpgroup products
/// ([`warpgroup`](super::backward::warpgroup)).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct WarpgroupBackwardConfig {
    /// Width of queries, keys and values (64 or 128).
    pub head_dim: usize,
    /// Keys right of a diagonal are hidden (causal, a window's right side).
    pub causal: bool,
    /// The inputs are bf16 (else f16).
    pub bf16: bool,
    /// dQ added by f32 atomics from this launch (`dS·K` over the cube's keys); else dQ is
    /// another launch's (the deterministic dQ), and this one computes dK and dV alone.
    pub atomic_dq: bool,
}

impl WarpgroupBackwardConfig {
    /// Warpgroups of a cube, 64 owned keys each.
    pub const WARPGROUPS: usize = 2;
    /// Query rows per stage: the scores products' `n`, the gradients products' reduced dim.
    pub const BLOCK_Q: usize = 64;
    /// Stages of Q and dO in the ring: a block's copies run while the one before it computes.
    pub const STAGES: usize = 3;

    /// Keys a cube owns.
    pub fn block_k(&self) -> usize {
        64 * Self::WARPGROUPS
    }

    /// Units of a cube: the warpgroups' (the first unit also issues the copies).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn units(&self) -> usize {
        128 * Self::WARPGROUPS
    }

    /// Elements of the `dSᵀ` buffers of the owned keys, two for the atomic dQ's products (none
    /// needed without them: one 64-element placeholder).
    pub fn scores_grad_elems(&self) -> usize {
        if self.atomic_dq {
            2 * self.block_k() * 64
        } else {
            64
        }
    }

    /// Shared memory of one cube for 16-bit inputs: the owned keys and values, the ring of Q
    /// and dO, the `dSᵀ` buffers, each on a 1024-byte boundary, plus their barriers.
    pub fn shared_bytes(&self) -> usize {
        let rows = 2 * self.block_k() + 2 * Self::STAGES * Self::BLOCK_Q;
        (rows * self.head_dim + self.scores_grad_elems()) * 2 + 5 * TMA_ALIGN + 7 * 8
    }
}

/// Which bounds hide keys around the diagonal (see [`mask`](super::mask)), and whether a boolean
/// mask input hides some more; the offsets and the mask are runtime values.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub struct MaskConfig {
    /// Keys right of the diagonal by more than an offset are hidden (causal: offset 0).
    pub right: bool,
    /// Keys left of the diagonal by more than an offset are hidden (sliding window).
    pub left: bool,
    /// A boolean mask input hides (query, key) pairs element by element.
    pub tensor: bool,
    /// The mask input is the same for every query (`[b|1, h|1, 1, seq_k]`, key padding): it is
    /// read once per key instead of once per pair.
    pub per_key: bool,
    /// The mask input reaches the tensor-core forward packed, a bit per pair
    /// ([`pack`](super::pack)), and is staged as words.
    pub packed: bool,
    /// The diagonal of query `i` is key `i` (top-left alignment) rather than
    /// `i + seq_k - seq_q` (bottom-right, Burn's default); it places the band and ALiBi. Set
    /// only where the two differ (`seq_q != seq_k`) and something reads the diagonal.
    pub top_left: Switch,
}

impl TileConfig {
    /// Tensor cores: `planes` planes of `plane_rows` query rows each, `block_kv`-row KV stages
    /// double-buffered.
    pub fn tensor_core(
        head_dim: usize,
        value_dim: usize,
        planes: usize,
        plane_rows: usize,
        block_kv: usize,
    ) -> Self {
        Self {
            tile: TilePath::TensorCore,
            head_dim,
            value_dim,
            block_q: planes * plane_rows,
            block_kv,
            planes,
            plane_rows,
            split: 1,
            owned_in_smem: false,
            mask: MaskConfig::default(),
            bias: false,
            bias_grad: false,
            softcap: false,
            bounded_max: false,
            dropout: false,
            alibi: false,
            atomic_dq: false,
            tma: false,
            staged: Staged::default(),
            batch_inner: false,
            tail: TailPart::All,
            kv_split: Switch(false),
            key_lengths: Switch(false),
            paged: Switch(false),
            varlen: Switch(false),
            three_kv_stages: Switch(false),
        }
    }

    /// Portable FMAs: one unit per query row; small KV stages fit 32 KiB of shared memory in f32
    /// (8 rows where heads are wider than 128).
    pub fn portable(head_dim: usize, value_dim: usize) -> Self {
        Self {
            tile: TilePath::Portable,
            head_dim,
            value_dim,
            block_q: 32,
            block_kv: if head_dim.max(value_dim) > 128 { 8 } else { 16 },
            planes: 1,
            plane_rows: 1,
            split: 1,
            owned_in_smem: false,
            mask: MaskConfig::default(),
            bias: false,
            bias_grad: false,
            softcap: false,
            bounded_max: false,
            dropout: false,
            alibi: false,
            atomic_dq: false,
            tma: false,
            staged: Staged::default(),
            batch_inner: false,
            tail: TailPart::All,
            kv_split: Switch(false),
            key_lengths: Switch(false),
            paged: Switch(false),
            varlen: Switch(false),
            three_kv_stages: Switch(false),
        }
    }

    /// These blocks with the score transform of `params`.
    pub fn with_scores(self, params: &ScoreParams) -> Self {
        Self {
            mask: params.mask,
            bias: params.bias,
            softcap: params.softcap.is_some(),
            dropout: params.dropout.is_some(),
            alibi: params.alibi_pow2.is_some(),
            ..self
        }
    }

    /// These blocks with the score inputs of `staged` staged in shared memory.
    pub fn with_staged(self, staged: Staged) -> Self {
        Self { staged, ..self }
    }

    /// These blocks reading their mask input packed ([`MaskConfig::packed`]) or not.
    pub fn with_packed_mask(mut self, packed: bool) -> Self {
        self.mask.packed = packed;
        self
    }

    /// These blocks launched with batches stepped through before heads (`true`) or after.
    pub fn with_batch_inner(self, batch_inner: bool) -> Self {
        Self {
            batch_inner,
            ..self
        }
    }

    /// These blocks as `tail`'s part of a split launch ([`tail`](Self::tail)).
    pub fn with_tail(self, tail: TailPart) -> Self {
        Self { tail, ..self }
    }

    /// These blocks writing the bias gradient from the dQ launch (`true`) or not.
    pub fn with_bias_grad(self, bias_grad: bool) -> Self {
        Self { bias_grad, ..self }
    }

    /// These blocks with dQ added by atomics from the dK/dV launch (`true`) or computed by its
    /// own launch.
    pub fn with_atomic_dq(self, atomic_dq: bool) -> Self {
        Self { atomic_dq, ..self }
    }

    /// These blocks with the forward's keys split across cubes ([`kv_split`](Self::kv_split)).
    pub fn with_kv_split(self) -> Self {
        Self {
            kv_split: Switch(true),
            ..self
        }
    }

    /// These blocks reading per-sequence key lengths ([`key_lengths`](Self::key_lengths)).
    pub fn with_key_lengths(self) -> Self {
        Self {
            key_lengths: Switch(true),
            ..self
        }
    }

    /// These blocks reading packed sequences ([`varlen`](Self::varlen)).
    pub fn with_varlen(self) -> Self {
        Self {
            varlen: Switch(true),
            ..self
        }
    }

    /// These blocks with keys and values in three stages
    /// ([`three_kv_stages`](Self::three_kv_stages)) where `three`. The staged mask and bias keep
    /// two stages: only blocks without them take three.
    pub fn with_three_kv_stages(self, three: bool) -> Self {
        assert!(
            !three || (self.staged == Staged::default() && !self.mask.packed),
            "three KV stages stage no score inputs and skip no blocks"
        );
        Self {
            three_kv_stages: Switch(three),
            ..self
        }
    }

    /// Shared-memory stages the tensor-core forward's keys and values cycle through: one block
    /// is computed while the others are in flight.
    pub fn kv_stages(&self) -> usize {
        if self.three_kv_stages.0 { 3 } else { 2 }
    }

    /// These blocks reading a paged cache ([`paged`](Self::paged)).
    pub fn with_pages(self) -> Self {
        Self {
            paged: Switch(true),
            ..self
        }
    }

    /// These blocks with their staged blocks copied by tensor maps ([`tma`](Self::tma)).
    pub fn with_tma(self) -> Self {
        assert!(
            self.can_stage_by_tma(),
            "no tensor-map staging for {self:?}"
        );
        Self { tma: true, ..self }
    }

    /// Whether [`with_tma`](Self::with_tma) accepts these blocks: the tensor-core tile with
    /// staged rows of 64 or 128 16-bit elements, the same on both operands. The copy engine's
    /// 128-byte swizzle of a box of 64 columns is the stages' own chunk swizzle when a stage
    /// starts on a 1024-byte boundary; wider rows are staged as panels of 64 columns, one box
    /// each ([`staged_pitch`](Self::staged_pitch)).
    pub fn can_stage_by_tma(&self) -> bool {
        self.tile == TilePath::TensorCore
            && matches!(self.head_dim, 64 | 128)
            && self.value_dim == self.head_dim
            && self.head_stride() == self.head_dim
            && self.value_stride() == self.head_dim
            && self.block_kv <= 256
    }

    /// The layout of the staged blocks `width` wide (K and V in the forward, Q and dO in the
    /// dK/dV launch, K and V in the dQ launch): whole rows, or with [`tma`](Self::tma) and rows
    /// wider than 128 bytes, panels of 64 columns as the tensor maps write them.
    pub fn staged_pitch(&self, width: usize) -> Pitch {
        if self.tma && width > 8 * CHUNK {
            Pitch::panels(self.block_kv)
        } else {
            Pitch::rows(width)
        }
    }

    /// These blocks with the owned operands read from shared memory per staged block at every
    /// head dim (tensor-core tile): for launches whose scores need the registers that holding
    /// them would take.
    pub fn with_owned_in_smem(self) -> Self {
        Self {
            owned_in_smem: true,
            ..self
        }
    }

    /// Tensor-core tile: whether the owned block stays in shared memory, its fragments re-read
    /// for each staged block instead of held in registers: above head dim 64, where registers
    /// would not hold them beside the scores and the output accumulators, or where
    /// [`owned_in_smem`](Self::owned_in_smem) asks for it.
    pub fn query_in_smem(&self) -> bool {
        self.tile == TilePath::TensorCore && (self.head_dim > 64 || self.owned_in_smem)
    }

    /// These blocks with `split` planes sharing each group of owned rows (see
    /// [`split`](Self::split)): the cube then owns `planes / split · plane_rows` rows. The
    /// exchanged block and each plane's part of the staged rows and of the accumulator columns
    /// must be whole 64-element swizzle groups, so that a plane's part starts at a runtime offset
    /// the swizzle does not see.
    pub fn with_split(self, split: usize) -> Self {
        assert!(self.can_split(split), "no {split}-way split of {self:?}");
        Self {
            split,
            block_q: self.planes / split * self.plane_rows,
            ..self
        }
    }

    /// Whether [`with_split`](Self::with_split) accepts `split` for these blocks.
    pub fn can_split(&self, split: usize) -> bool {
        split == 1
            || (self.tile == TilePath::TensorCore
                && split > 0
                && self.planes.is_multiple_of(split)
                && self.block_kv.is_multiple_of(64)
                && (self.block_kv / split).is_multiple_of(MMA_K)
                && [self.head_dim, self.value_dim].iter().all(|&dim| {
                    // Each part whole swizzle groups, or half of one (`tile::mma::part_start`).
                    dim.is_multiple_of(split)
                        && ((dim / split).is_multiple_of(64) || dim / split == 32)
                }))
    }

    /// Scratch elements of the dK/dV launch: the transpose of dS for the atomic dQ, or the
    /// exchanged `P` and `dS` blocks of a split ([`exchange_slots`](Self::exchange_slots) of
    /// `block_q × block_kv`).
    pub fn scratch_elems(&self) -> usize {
        if (self.atomic_dq || self.split > 1) && self.tile == TilePath::TensorCore {
            self.exchange_slots() * self.block_q * self.block_kv
        } else {
            1
        }
    }

    /// Staged rows per plane of the atomic dQ's product (`Gᵀ · owned`): the staged block over
    /// the groups of split planes.
    pub fn dq_plane_rows(&self) -> usize {
        self.block_kv / (self.planes / self.split)
    }

    /// Columns of the atomic dQ's product per pass: a plane's part of the head dim is covered
    /// 64 columns at a time (32 where 64 does not divide it), so that the f32 accumulators
    /// (32 registers per 64 columns) fit beside dK and dV.
    pub fn dq_chunk_cols(&self) -> usize {
        if (self.head_dim / self.split).is_multiple_of(64) {
            64
        } else {
            32
        }
    }

    /// f32 elements of the atomic dQ's staging on the tensor-core tile: each plane's rows of
    /// one chunk, rows padded by 8 columns so that the 8 rows of a quad's pairs fall in
    /// distinct banks.
    pub fn dq_stage_elems(&self) -> usize {
        if self.atomic_dq && self.tile == TilePath::TensorCore {
            self.planes * self.dq_plane_rows() * (self.dq_chunk_cols() + 8)
        } else {
            1
        }
    }

    /// Blocks a split's exchange holds at once: two (`P`, then `dS` below it) in the atomic
    /// single pass, whose one cube per SM has the shared memory, so that one barrier publishes
    /// both; one elsewhere (the deterministic launch would lose its second cube per SM), where
    /// `dS` waits for every plane to be done reading `P`.
    pub fn exchange_slots(&self) -> usize {
        if self.atomic_dq && self.split > 1 {
            2
        } else {
            1
        }
    }

    /// The same blocks and layout for products of other widths: the backward multiplies
    /// `V·dOᵀ` (both `value_dim` wide) beside `K·Qᵀ`, and accumulates `dS·Q` (`head_dim` wide)
    /// beside `P·dO`.
    pub fn with_widths(self, head_dim: usize, value_dim: usize) -> Self {
        Self {
            head_dim,
            value_dim,
            ..self
        }
    }

    /// The forward leaves softcapped scores as `tanh(inner · s)` and folds the cap's outer factor
    /// into the softmax scale: nothing is added to the scores after the cap.
    pub fn softcap_outer_in_scale(&self) -> bool {
        self.softcap && !self.bias && !self.alibi
    }

    /// These blocks with the softmax's max fixed at the softcap's bound where that is exact:
    /// with nothing added after the cap, every scaled score lies in `[−cap, cap]`, so
    /// `exp(x − cap)` lies in `[e^(−2·cap), 1]`; where that range is inside
    /// [`BOUNDED_MAX_RANGE`] and the probabilities keep f32's exponent range (`p_wide_range`:
    /// bf16 or f32 inputs), no visible probability underflows, and the forward skips the row
    /// max, its reductions and the rescale of the output.
    pub fn with_bounded_max(self, softcap: Option<f32>, p_wide_range: bool) -> Self {
        let in_range =
            softcap.is_some_and(|cap| 2.0 * cap * core::f32::consts::LOG2_E <= BOUNDED_MAX_RANGE);
        Self {
            bounded_max: self.softcap_outer_in_scale() && p_wide_range && in_range,
            ..self
        }
    }

    /// m16 row blocks each plane owns (tensor-core tile).
    pub fn m_tiles(&self) -> usize {
        self.plane_rows / MMA_M
    }

    /// Staged columns each plane computes scores for (its part of the block).
    pub fn score_cols(&self) -> usize {
        self.block_kv / self.split
    }

    /// Accumulator columns each plane holds (its part of `value_dim`).
    pub fn out_cols(&self) -> usize {
        self.value_dim / self.split
    }

    /// Score registers each unit holds for one KV block.
    pub fn score_regs(&self) -> usize {
        match self.tile {
            TilePath::TensorCore => self.m_tiles() * self.score_cols() / MMA_N * 4,
            TilePath::Portable => self.block_kv,
        }
    }

    /// Whether the backward takes `P = exp(S − lse)` before issuing dP's product, then
    /// `dS = P ∘ (dP − D)` (head dims above 64, and the atomic dQ's single pass), or issues
    /// both products first and forms `P` and `dS` in one pass (the other launches at 64 and
    /// below). The same work, which ptxas schedules and spills differently at 255 registers: on
    /// the H100 the first order measured up to 4 % faster at head dim 128 and 1 % slower at 64
    /// not causal, where it spilled 16 accumulators (`docs/perf-notes.md`, 2026-11-27,
    /// 29ce03e), until [`dp_waits_for_probs`](Self::dp_waits_for_probs).
    pub fn probs_before_dp(&self) -> bool {
        self.value_dim > 64 || self.dp_waits_for_probs()
    }

    /// Whether dP's product starts from accumulators that depend on `P` (the atomic dQ's single
    /// pass): ptxas then issues the exponentials between dP's MMAs instead of after every
    /// product. Measured up to 4.4 % faster there at head dims 64 and 128 (−0.1 % at one of
    /// eight rows), and up to 2.9 % slower in the deterministic launches (`docs/perf-notes.md`,
    /// 2026-11-27, b46a0b7).
    pub fn dp_waits_for_probs(&self) -> bool {
        self.atomic_dq && self.tile == TilePath::TensorCore
    }

    /// Output accumulator registers each unit holds.
    pub fn out_regs(&self) -> usize {
        match self.tile {
            TilePath::TensorCore => self.m_tiles() * self.out_cols() / MMA_N * 4,
            TilePath::Portable => self.value_dim,
        }
    }

    /// Query rows each unit keeps softmax statistics for.
    pub fn rows_per_unit(&self) -> usize {
        match self.tile {
            // An accumulator lane holds rows g and g + 8 of each m16 block.
            TilePath::TensorCore => 2 * self.m_tiles(),
            TilePath::Portable => 1,
        }
    }

    /// Which of the unit's rows score register `reg` belongs to.
    pub fn score_slot(&self, reg: usize) -> usize {
        self.slot(reg, self.score_cols())
    }

    /// The first score register of this unit that stands for the same key as register `reg`
    /// (keys are columns, or rows when `transposed`). The tensor-core accumulator holds
    /// columns 2t, 2t + 1 of each n-tile for rows g and g + 8 of each m16 block.
    pub fn key_reg(&self, reg: usize, transposed: bool) -> usize {
        match (self.tile, transposed) {
            (TilePath::Portable, false) => reg,
            // A portable unit owns one row: one key.
            (TilePath::Portable, true) => 0,
            (TilePath::TensorCore, false) => (reg % self.score_regs_per_m_tile()) & !2,
            (TilePath::TensorCore, true) => {
                let per_m_tile = self.score_regs_per_m_tile();
                reg / per_m_tile * per_m_tile + (reg & 2)
            }
        }
    }

    /// How score register `reg` draws dropout's bits (`kernel/dropout.rs`): one hash per query
    /// and key group `{16u + 2s, +1, +8, +9}`, drawn by the first register of the group this
    /// unit holds. The tensor-core accumulator holds columns `2t`, `2t + 1` of n-tiles `2u` and
    /// `2u + 1` (one group of a query) in registers `r`, `r + 1`, `r + 4`, `r + 5`; transposed,
    /// keys `g` and `g + 8` of one query in registers `r` and `r + 2`. Every drawing register's
    /// key is register 0's plus a step that carries into no bit below 4, so its group is
    /// register 0's plus the step's (`keep_mask` adds it).
    pub fn dropout_draw(&self, reg: usize, transposed: bool) -> DropoutDraw {
        let known = |owner: usize, byte: usize| DropoutDraw {
            owner,
            byte: Some(byte),
        };
        match (self.tile, transposed) {
            (TilePath::TensorCore, false) => {
                // Every block shape the launches build has whole 16-key groups per plane.
                assert!(self.score_cols().is_multiple_of(16), "{self:?}");
                known(reg & !0b101, (reg >> 2 & 1) << 1 | reg & 1)
            }
            (TilePath::Portable, false) if self.block_kv.is_multiple_of(16) => {
                known(reg & !0b1001, (reg >> 3 & 1) << 1 | reg & 1)
            }
            // The byte depends on the lane's key (`g` odd or even).
            (TilePath::TensorCore, true) => DropoutDraw {
                owner: reg & !2,
                byte: None,
            },
            // A hash per register: transposed, the unit's one key for a query per register;
            // else 8-key blocks, which hold half a group.
            (TilePath::Portable, _) => DropoutDraw {
                owner: reg,
                byte: None,
            },
        }
    }

    /// Column of score register `reg` past the unit's first (register 0's) in the forward: the
    /// tensor-core accumulator holds columns 8t + 2·(lane % 4) and the next of n-tile `t`, a
    /// portable unit column `reg` of its row.
    pub fn score_col_step(&self, reg: usize) -> usize {
        match self.tile {
            TilePath::TensorCore => {
                let local = reg % self.score_regs_per_m_tile();
                local / 4 * MMA_N + local % 2
            }
            TilePath::Portable => reg,
        }
    }

    /// Score registers of one m16 block (tensor-core tile).
    fn score_regs_per_m_tile(&self) -> usize {
        self.score_cols() / MMA_N * 4
    }

    /// Which of the unit's rows output register `reg` belongs to.
    pub fn out_slot(&self, reg: usize) -> usize {
        self.slot(reg, self.out_cols())
    }

    /// Row slot of register `reg` of an accumulator `cols` wide: registers are grouped by m16
    /// block, and within an m16n8 tile come as (c0, c1) of row g then (c2, c3) of row g + 8.
    fn slot(&self, reg: usize, cols: usize) -> usize {
        match self.tile {
            TilePath::TensorCore => reg / (cols / MMA_N * 4) * 2 + (reg / 2) % 2,
            TilePath::Portable => 0,
        }
    }

    /// Elements between consecutive rows of a staged block `width` wide. The swizzle moves a
    /// 16-byte chunk within its group of eight, so swizzled rows span whole groups: head dims 32
    /// and 96 are stored 64 and 128 wide (their extra chunks are never read).
    pub fn stride(&self, width: usize) -> usize {
        if self.swizzle() {
            width.div_ceil(8 * CHUNK) * 8 * CHUNK
        } else {
            width
        }
    }

    /// [`stride`](Self::stride) of the score product's rows (queries and keys).
    pub fn head_stride(&self) -> usize {
        self.stride(self.head_dim)
    }

    /// [`stride`](Self::stride) of the second product's rows (values).
    pub fn value_stride(&self) -> usize {
        self.stride(self.value_dim)
    }

    /// Rows of a staged mask block: one where the mask is the same for every query.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn mask_rows(&self) -> usize {
        if self.mask.per_key { 1 } else { self.block_q }
    }

    /// Elements of one staged mask block: `mask_rows × block_kv`, or, packed, a word per 32 keys
    /// of each of the `block_q` rows.
    pub fn mask_stage_len(&self) -> usize {
        if self.mask.packed {
            self.block_q * self.packed_words()
        } else {
            self.mask_rows() * self.block_kv
        }
    }

    /// Words of a packed mask per query row of one KV block.
    pub fn packed_words(&self) -> usize {
        self.block_kv / 32
    }

    /// Bytes of the stages of each staged score input (elements of `16 / chunk` bytes).
    fn staged_bytes(&self) -> usize {
        let mask = self
            .staged
            .mask
            .map(|chunk| (2 * self.mask_stage_len(), chunk));
        let bias = self.staged.bias.map(|chunk| {
            let len = self.staged.bias_stages() * self.block_q * self.block_kv;
            (len, chunk)
        });
        [mask, bias]
            .into_iter()
            .flatten()
            .map(|(len, chunk)| len * (16 / chunk))
            .sum()
    }

    /// Bytes of shared memory one cube uses.
    pub fn shared_bytes(&self, elem_size: usize) -> usize {
        let stages = match self.tile {
            TilePath::TensorCore => self.kv_stages(),
            TilePath::Portable => 1,
        };
        let query = if self.tile == TilePath::TensorCore {
            self.block_q * self.head_stride()
        } else {
            0
        };
        // Tensor-map stages start on their own boundary: at most that much padding before each.
        let padding = if self.tma { 2 * TMA_ALIGN } else { 0 };
        (query + stages * self.block_kv * (self.head_stride() + self.value_stride())) * elem_size
            + self.staged_bytes()
            + padding
    }

    /// Bytes of shared memory one backward cube uses: the forward's, plus the second owned
    /// operand (values or output gradients), which the tensor-core tile stages too, plus the
    /// scratch of the atomic dQ or of a split.
    pub fn backward_shared_bytes(&self, elem_size: usize) -> usize {
        let second = if self.tile == TilePath::TensorCore {
            self.block_q * self.value_stride()
        } else {
            0
        };
        self.shared_bytes(elem_size)
            + (second + self.scratch_elems()) * elem_size
            + (self.stats_elems() + self.dq_stage_elems()) * 4
    }

    /// f32 elements of the backward's staged query statistics (log-sum-exp and D per staged
    /// row), per stage: two stages on the tensor-core tile, one on the portable tile.
    pub fn stats_elems(&self) -> usize {
        let stages = if self.tile == TilePath::TensorCore {
            2
        } else {
            1
        };
        stages * 2 * self.block_kv
    }

    /// Statistics each unit fetches per staged block (`2 · block_kv` over the cube's units).
    pub fn stats_per_unit(&self) -> usize {
        (2 * self.block_kv).div_ceil(self.units())
    }

    /// Whether shared-memory rows are stored with their 16-byte chunks XOR-swizzled by row, so
    /// that `ldmatrix` reads of 8 rows hit 8 different bank groups.
    pub fn swizzle(&self) -> bool {
        self.tile == TilePath::TensorCore
    }

    /// Units per cube.
    pub fn units(&self) -> usize {
        match self.tile {
            TilePath::TensorCore => 32 * self.planes,
            TilePath::Portable => self.block_q,
        }
    }
}

/// Runtime values of one call's score transform: the kernels specialise on `mask`, on `bias` and
/// on whether `softcap` and `dropout` are set, and take the numbers (and the mask and bias
/// tensors) as arguments.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreParams {
    /// Factor of `Q·Kᵀ`.
    pub scale: f32,
    /// Which band bounds exist, and whether a boolean mask input is given.
    pub mask: MaskConfig,
    /// Whether an additive bias input is given.
    pub bias: bool,
    /// Keys left of the diagonal that stay visible, when `mask.left`.
    pub left: u32,
    /// Keys right of the diagonal that stay visible, when `mask.right` (0 for causal).
    pub right: u32,
    /// The softcap, if any.
    pub softcap: Option<f32>,
    /// Dropout of the probabilities, if any.
    pub dropout: Option<DropoutParams>,
    /// With ALiBi, the largest power of two not above the query head count (its slopes' base).
    pub alibi_pow2: Option<u32>,
    /// Cubes each row block's keys are split across in the forward ([`TileConfig::kv_split`]);
    /// `None` leaves it to the plan, which splits where the row blocks alone leave SMs idle.
    pub kv_splits: Option<usize>,
    /// With one query per sequence, the forward takes the query heads that share a key/value
    /// head as the rows of one block, where nothing else depends on the row (on by default).
    pub pack_groups: bool,
}

/// How one score register draws dropout's bits ([`TileConfig::dropout_draw`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DropoutDraw {
    /// The register that hashes the group's counter.
    pub owner: usize,
    /// The byte of the hash this register reads, when known at compile time.
    pub byte: Option<usize>,
}

/// The launch arguments of dropout: the seed's halves and the keep threshold out of 2⁸.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutParams {
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub threshold: u32,
}

impl ScoreParams {
    /// The kernel view of `options` for `heads` query heads of `seq_q` rows over `seq_k` keys
    /// with this head dim, without mask or bias inputs (see [`with_inputs`](Self::with_inputs)).
    /// A window side too wide to hide any key is dropped, so the kernels neither mask nor skip
    /// for it, and kept offsets stay below `seq_q + seq_k` (no index overflow).
    pub fn new(
        options: &crate::options::FlashAttentionOptions,
        heads: usize,
        head_dim: usize,
        seq_q: usize,
        seq_k: usize,
    ) -> Self {
        let window = options.window.unwrap_or_default();
        // The diagonal of query i is key i + shift, shift = seq_k - seq_q (bottom-right) or 0
        // (top-left).
        let top_left = options.causal_alignment == burn::tensor::ops::CausalAlignment::TopLeft
            && seq_q != seq_k;
        let (diag_q, diag_k) = if top_left { (0, 0) } else { (seq_q, seq_k) };
        // Query i sees keys from i + shift - left: every key once left >= seq_q + shift (the
        // last query's bound is then below 0; bottom-right: left >= seq_k) ...
        let left = window.left.filter(|&left| left + diag_q < seq_q + diag_k);
        // ... up to i + shift + right: every key once right >= seq_k - shift (bottom-right:
        // right >= seq_q).
        let right = match (options.causal, window.right) {
            (true, _) => Some(0),
            (false, right) => right.filter(|&right| right + diag_k < seq_k + diag_q),
        };
        let offset = |value: Option<usize>| {
            u32::try_from(value.unwrap_or(0)).expect("a window side shorter than the sequence")
        };
        Self {
            scale: options.scale_for(head_dim) as f32,
            mask: MaskConfig {
                right: right.is_some(),
                left: left.is_some(),
                tensor: false,
                per_key: false,
                packed: false,
                top_left: Switch(top_left && (left.is_some() || right.is_some() || options.alibi)),
            },
            bias: false,
            left: offset(left),
            right: offset(right),
            softcap: options.softcap.map(|cap| cap as f32),
            dropout: options
                .dropout
                .filter(|d| d.is_active())
                .map(|d| DropoutParams {
                    seed_lo: d.seed as u32,
                    seed_hi: (d.seed >> 32) as u32,
                    threshold: d.keep_threshold(),
                }),
            alibi_pow2: (options.alibi && heads > 0).then(|| 1 << heads.ilog2()),
            kv_splits: None,
            pack_groups: true,
        }
    }

    /// These parameters with the forward packing grouped query heads into rows
    /// ([`pack_groups`](Self::pack_groups)) where it can, or never.
    pub fn with_pack_groups(self, pack: bool) -> Self {
        Self {
            pack_groups: pack,
            ..self
        }
    }

    /// These parameters for keys cut to per-sequence lengths
    /// ([`forward`](crate::kernel::forward)'s `key_lengths`): where `options` align top-left,
    /// the alignment is kept even where the padded `seq_k` equals `seq_q`, since a shorter
    /// sequence's bottom-right diagonal lies elsewhere.
    pub fn with_key_lengths(self, options: &crate::options::FlashAttentionOptions) -> Self {
        let top_left = options.causal_alignment == burn::tensor::ops::CausalAlignment::TopLeft
            && (self.mask.left || self.mask.right || self.alibi_pow2.is_some());
        Self {
            mask: MaskConfig {
                top_left: Switch(top_left),
                ..self.mask
            },
            ..self
        }
    }

    /// These parameters with the forward's keys split across `splits` cubes per row block,
    /// whatever the plan would choose.
    pub fn with_kv_splits(self, splits: usize) -> Self {
        assert!(splits > 0, "a key sequence splits into one part at least");
        Self {
            kv_splits: Some(splits),
            ..self
        }
    }

    /// Plain or causal attention: no mask or bias input, window's left side, softcap, dropout
    /// or ALiBi (what the Hopper kernels run).
    pub fn plain_or_causal(&self) -> bool {
        !self.mask.left
            && !self.mask.tensor
            && !self.bias
            && self.softcap.is_none()
            && self.dropout.is_none()
            && self.alibi_pow2.is_none()
    }

    /// These parameters with a boolean mask input of `mask_dims` (`[b|1, h|1, sq|1, sk]`) and
    /// an additive bias (`bias`), or not.
    pub fn with_inputs(mut self, mask_dims: Option<&[usize]>, bias: bool) -> Self {
        self.mask.tensor = mask_dims.is_some();
        self.mask.per_key = mask_dims.is_some_and(|dims| dims[2] == 1);
        self.bias = bias;
        self
    }

    /// Dropout's launch arguments; any valid values when there is no dropout (the kernels then
    /// never read them).
    pub fn dropout_args(&self) -> (u32, u32, u32) {
        let DropoutParams {
            seed_lo,
            seed_hi,
            threshold,
        } = self.dropout.unwrap_or(DropoutParams {
            seed_lo: 0,
            seed_hi: 0,
            threshold: 256,
        });
        (seed_lo, seed_hi, threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A split keeps every plane's registers those of its own part: the group's rows, its
    /// share of the staged columns and of the accumulator columns.
    #[test]
    fn split_shares_rows_and_divides_columns() {
        let base = TileConfig::tensor_core(128, 128, 8, 32, 64);
        assert!(base.can_split(2));
        let split = base.with_split(2);
        assert_eq!(split.block_q, 128);
        assert_eq!(split.score_cols(), 32);
        assert_eq!(split.out_cols(), 64);
        assert_eq!(split.score_regs(), 2 * 4 * 4);
        assert_eq!(split.out_regs(), 2 * 8 * 4);
        assert_eq!(split.scratch_elems(), 128 * 64);
        // Two m16 blocks of 32 columns: the slots follow the m16 block, not the column part.
        assert_eq!(split.score_slot(16), 2);
        // Keys are the part's columns: the same in both m16 blocks (rows, when transposed).
        assert_eq!(split.key_reg(16 + 7, false), 5);
        assert_eq!(split.key_reg(16 + 7, true), 16 + 2);
        // A part must be whole 64-element swizzle groups, on the tensor cores only.
        // Half a swizzle group per part (d 64) is allowed, 48 columns are not.
        assert!(TileConfig::tensor_core(64, 64, 4, 32, 64).can_split(2));
        assert!(!TileConfig::tensor_core(96, 96, 4, 32, 64).can_split(2));
        assert!(!TileConfig::tensor_core(128, 128, 4, 32, 32).can_split(2));
        assert!(!TileConfig::tensor_core(128, 128, 3, 32, 64).can_split(2));
        assert!(!TileConfig::portable(128, 128).can_split(2));
        assert!(TileConfig::portable(128, 128).can_split(1));
    }

    /// A score register's column past the unit's first: n-tile by n-tile, each pair of
    /// neighbouring columns twice (rows g and g + 8), the same in every m16 block.
    #[test]
    fn score_columns_step_by_n_tile() {
        let cfg = TileConfig::tensor_core(64, 64, 4, 32, 64);
        let steps: Vec<usize> = (0..12).map(|reg| cfg.score_col_step(reg)).collect();
        assert_eq!(steps, [0, 1, 0, 1, 8, 9, 8, 9, 16, 17, 16, 17]);
        assert_eq!(cfg.score_col_step(31), 57);
        assert_eq!(cfg.score_col_step(32), 0);
        assert_eq!(TileConfig::portable(64, 64).score_col_step(5), 5);
    }

    /// Dropout's draws against a model of the score registers (the m16n8 accumulator: lane
    /// `4g + t` holds columns `2t`, `2t + 1` of rows `g`, `g + 8`; a portable unit one row):
    /// every register shares its owner's query and key group, reads the byte its key names,
    /// and an owner's group is register 0's plus the step `keep_mask` adds.
    #[test]
    fn dropout_draws_match_the_register_layout() {
        let group = |key: usize| key / 16 * 4 + key / 2 % 4;
        let byte = |key: usize| key % 2 + key / 8 % 2 * 2;
        // (row, column) of score register `reg` of unit `unit`.
        type Layout = fn(TileConfig, usize, usize) -> (usize, usize);
        let tensor_core: Layout = |cfg, lane, reg| {
            let per_m_tile = cfg.score_cols() / MMA_N * 4;
            let (m, local) = (reg / per_m_tile, reg % per_m_tile);
            let row = m * MMA_M + lane / 4 + local % 4 / 2 * 8;
            (row, local / 4 * MMA_N + lane % 4 * 2 + local % 2)
        };
        let portable: Layout = |_cfg, unit, reg| (unit, reg);
        let layouts = [
            (TileConfig::tensor_core(64, 64, 4, 32, 64), tensor_core),
            (TileConfig::tensor_core(128, 128, 4, 32, 32), tensor_core),
            (
                TileConfig::tensor_core(128, 128, 8, 32, 64).with_split(2),
                tensor_core,
            ),
            (TileConfig::portable(64, 64), portable),
            (TileConfig::portable(16, 136), portable),
        ];
        for (cfg, position) in layouts {
            for transposed in [false, true] {
                let starts = [0, cfg.block_kv, 3 * cfg.block_kv];
                for (unit, start) in (0..32).flat_map(|u| starts.map(|s| (u, s))) {
                    // (query, key) of a register, the block's keys starting at `start` (a
                    // multiple of the block: 8 keys for the last portable tile).
                    let pair = |reg: usize| {
                        let (row, col) = position(cfg, unit, reg);
                        if transposed {
                            (col, start + row)
                        } else {
                            (row, start + col)
                        }
                    };
                    let (query0, key0) = pair(0);
                    for reg in 0..cfg.score_regs() {
                        let draw = cfg.dropout_draw(reg, transposed);
                        let ((query, key), (owner_query, owner_key)) =
                            (pair(reg), pair(draw.owner));
                        let label =
                            format!("{cfg:?} transposed {transposed} unit {unit} reg {reg}");
                        assert!(draw.owner <= reg, "{label}");
                        assert_eq!(
                            (query, group(key)),
                            (owner_query, group(owner_key)),
                            "{label}"
                        );
                        if let Some(b) = draw.byte {
                            assert_eq!(b, byte(key), "{label}");
                        }
                        if draw.owner == reg {
                            let step = key - key0;
                            assert!(query >= query0, "{label}");
                            assert_eq!(
                                group(key),
                                group(key0) + step / 16 * 4 + step / 2 % 4,
                                "{label}"
                            );
                        }
                    }
                }
            }
        }
    }
}
