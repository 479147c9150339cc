//! A decoder-only GPT: learned token and position embeddings, pre-norm blocks of causal
//! self-attention and MLP, a final norm and an output head tied to the token embedding.

use burn::config::Config;
use burn::module::{Initializer, Module, ModuleMapper, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Gelu, LayerNorm, LayerNormConfig, Linear,
    LinearConfig,
};
use burn::tensor::{DType, Device, Int, Tensor};
use burn_flash::nn::{AttentionKernel, FlashMultiHeadAttention, FlashMultiHeadAttentionConfig};
use burn_flash::{FlashAttentionError, KvCache};

/// GPT-2's initialisation of embeddings and projections.
const INIT: Initializer = Initializer::Normal {
    mean: 0.0,
    std: 0.02,
};

/// The shape of a [`Gpt`] and its attention kernel.
#[derive(Config, Debug)]
pub struct GptConfig {
    /// Number of distinct tokens.
    pub vocab_size: usize,
    /// Longest sequence the position embedding covers.
    pub context: usize,
    /// Number of blocks.
    pub layers: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads per block.
    pub heads: usize,
    /// Dropout of the embeddings, the attention probabilities and the blocks' outputs, in
    /// training.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// What computes the attention.
    #[config(default = "AttentionKernel::Flash")]
    pub kernel: AttentionKernel,
}

/// The model: embeddings, blocks, final norm; the head is the token embedding.
#[derive(Module, Debug)]
pub struct Gpt {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    dropout: Dropout,
}

#[derive(Module, Debug)]
struct Block {
    attention_norm: LayerNorm,
    attention: FlashMultiHeadAttention,
    mlp_norm: LayerNorm,
    mlp_in: Linear,
    mlp_out: Linear,
    activation: Gelu,
    dropout: Dropout,
}

impl GptConfig {
    /// A model with freshly initialised weights on `device`.
    pub fn init(&self, device: &Device) -> Gpt {
        let linear = |d_in, d_out| {
            LinearConfig::new(d_in, d_out)
                .with_initializer(INIT)
                .init(device)
        };
        let blocks = (0..self.layers)
            .map(|_| Block {
                attention_norm: LayerNormConfig::new(self.d_model).init(device),
                // Causal self-attention: the module aligns the mask bottom-right (Burn's default
                // `CausalAlignment`), which with as many queries as keys is the usual `tril`.
                attention: FlashMultiHeadAttentionConfig::new(self.d_model, self.heads)
                    .with_causal(true)
                    .with_dropout(self.dropout)
                    .with_kernel(self.kernel)
                    .with_initializer(INIT)
                    .init(device),
                mlp_norm: LayerNormConfig::new(self.d_model).init(device),
                mlp_in: linear(self.d_model, 4 * self.d_model),
                mlp_out: linear(4 * self.d_model, self.d_model),
                activation: Gelu::new(),
                dropout: DropoutConfig::new(self.dropout).init(),
            })
            .collect();
        let embedding = |n| {
            EmbeddingConfig::new(n, self.d_model)
                .with_initializer(INIT)
                .init(device)
        };
        Gpt {
            tokens: embedding(self.vocab_size),
            positions: embedding(self.context),
            blocks,
            norm: LayerNormConfig::new(self.d_model).init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }
}

impl Gpt {
    /// Next-token logits `[batch, seq, vocab]`, in f32, of tokens `[batch, seq]`,
    /// `seq <= context`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [_, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..seq as i64, &device).unsqueeze::<2>();
        let mut x = self
            .dropout
            .forward(self.tokens.forward(tokens) + self.positions.forward(positions));
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.logits(self.norm.forward(x))
    }

    /// The head on the final norm's output `x: [batch, seq, d_model]`.
    fn logits(&self, x: Tensor<3>) -> Tensor<3> {
        // The head is the token embedding, transposed, and computes in f32: the logits feed an
        // f32 softmax, and in bf16 or f16 on Hopper Burn 0.23.0-pre.1 fails a product with at
        // least 4× more rows than columns (context >= 4 × vocab): its matmul autotune tries a
        // TMA kernel whose 512-row box CUDA refuses, and the refused launch poisons the
        // product's inputs (docs/gpt.md). f32 products take 16-row tiles.
        let head = self
            .tokens
            .weight
            .val()
            .cast(DType::F32)
            .transpose()
            .unsqueeze::<3>();
        x.cast(DType::F32).matmul(head)
    }

    /// Next-token logits `[batch, n, vocab]` of the newest tokens `[batch, n]` of each sequence,
    /// at positions `start..start + n`, through `caches` (one per block, from
    /// [`caches`](Self::caches)) that hold the earlier positions' keys and values and take the
    /// new ones: decoding without recomputing the earlier positions. `start + n <= context`.
    pub fn forward_cached(
        &self,
        tokens: Tensor<2, Int>,
        start: usize,
        caches: &mut [KvCache],
    ) -> Result<Tensor<3>, FlashAttentionError> {
        let [_, n] = tokens.dims();
        let device = tokens.device();
        let positions =
            Tensor::<1, Int>::arange(start as i64..(start + n) as i64, &device).unsqueeze::<2>();
        let mut x = self.tokens.forward(tokens) + self.positions.forward(positions);
        for (block, cache) in self.blocks.iter().zip(caches) {
            x = block.forward_cached(x, cache)?;
        }
        Ok(self.logits(self.norm.forward(x)))
    }

    /// Empty key/value caches for [`forward_cached`](Self::forward_cached): one per block, for
    /// `batch` sequences of up to `context` positions, in the model's dtype.
    pub fn caches(&self, batch: usize, device: &Device) -> Vec<KvCache> {
        self.blocks
            .iter()
            .map(|block| {
                let attention = &block.attention;
                KvCache::new(
                    [batch, attention.n_kv_heads, self.context(), attention.d_k],
                    attention.d_k,
                    self.dtype(),
                    device,
                )
            })
            .collect()
    }

    /// Mean cross-entropy of predicting `targets` (`[batch, seq]`) from `inputs`.
    pub fn loss(&self, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let [batch, seq] = inputs.dims();
        // The logits, the softmax and the loss in f32 whatever the compute dtype.
        let logits = self.forward(inputs);
        let vocab = logits.dims()[2];
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(
                logits.reshape([batch * seq, vocab]),
                targets.reshape([batch * seq]),
            )
    }

    /// The longest sequence the model takes.
    pub fn context(&self) -> usize {
        self.positions.weight.dims()[0]
    }

    /// This model computing in `dtype`: every float parameter cast to it. On an autodiff
    /// device the casts are recorded, so gradients flow back to this model's parameters in
    /// their own dtype: f32 weights and optimizer state, bf16 or f16 matmuls and attention
    /// (mixed precision, which Burn 0.23 does not automate).
    pub fn cast(&self, dtype: DType) -> Self {
        if self.dtype() == dtype {
            return self.clone();
        }
        self.clone().map(&mut Cast(dtype))
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> DType {
        self.tokens.weight.val().dtype()
    }
}

impl Block {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let attended = self
            .attention
            .forward_self(self.attention_norm.forward(x.clone()));
        self.mlp(x + self.dropout.forward(attended))
    }

    /// [`forward`](Self::forward) of the newest positions, the earlier ones in `cache`.
    fn forward_cached(
        &self,
        x: Tensor<3>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, FlashAttentionError> {
        let attended = self
            .attention
            .forward_cached(self.attention_norm.forward(x.clone()), cache)?;
        Ok(self.mlp(x + attended))
    }

    /// The MLP half, residual included.
    fn mlp(&self, x: Tensor<3>) -> Tensor<3> {
        let h = self.mlp_in.forward(self.mlp_norm.forward(x.clone()));
        x + self
            .dropout
            .forward(self.mlp_out.forward(self.activation.forward(h)))
    }
}

/// Casts float parameters to a dtype, keeping their ids.
struct Cast(DType);

impl ModuleMapper for Cast {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|tensor| tensor.cast(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    /// The cached path gives the logits of the whole-sequence forward: a prompt of 5 tokens,
    /// then 3 tokens one at a time, against the forward of all 8 at once.
    #[test]
    fn cached_decoding_gives_the_forward_logits() {
        let device = Device::wgpu(Default::default());
        let model = GptConfig::new(256, 16, 2, 32, 2).init(&device);
        let tokens: Vec<i32> = vec![72, 101, 108, 108, 111, 32, 119, 111];
        let all = Tensor::<2, Int>::from_data(TensorData::new(tokens.clone(), [1, 8]), &device);
        let expected = model.forward(all).into_data().try_to_vec::<f32>().unwrap();

        let mut caches = model.caches(1, &device);
        let input = |range: std::ops::Range<usize>| {
            let part = tokens[range.clone()].to_vec();
            Tensor::<2, Int>::from_data(TensorData::new(part, [1, range.len()]), &device)
        };
        let mut got = model
            .forward_cached(input(0..5), 0, &mut caches)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        for position in 5..8 {
            let step = model
                .forward_cached(input(position..position + 1), position, &mut caches)
                .unwrap();
            got.extend(step.into_data().try_to_vec::<f32>().unwrap());
        }
        assert_eq!(caches[0].lengths(), &[8]);
        let worst = got
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "cached logits differ by up to {worst}");
    }
}
