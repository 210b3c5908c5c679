//! Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on the CPU, over packed batches.
//!
//! Pre-norm residual blocks, as in the checkpoints:
//! `x += o_proj(attn(rope(q), rope(k), v))` on `input_layernorm(x)`, then
//! `x += down_proj(silu(gate_proj(h)) * up_proj(h))` on `post_attention_layernorm(x)`.
//! q/k/v and gate/up are fused into one GEMM each at load time. No LM head.

use super::frame::{self, Captures};
use super::{KvCache, ModelError};
use crate::batch::PackedBatch;
use crate::capture::{CaptureSet, Tap};
use crate::checkpoint::Checkpoint;
use crate::config::{LlamaConfig, RopeScaling};
use crate::cpu::attention::{varlen_attention, AttnSegment, AttnShape, KvRef};
use crate::cpu::ops::{rms_norm, rms_norm_heads_inplace, rope_head, swiglu};
use crate::cpu::PackedLinear;
use crate::quant::{LinearWeight, WeightFormat};
use crate::shape::{dim_from_size, CapturedStates, DType, Dim};
use crate::tp::{Collective, TpPlan};
use std::path::Path;
use std::sync::Arc;
use tracing::{debug_span, info_span};

/// Self-attention weights of one layer (`self_attn.*`).
struct SelfAttn {
    /// `q_proj`, `k_proj`, `v_proj` stacked: `[(heads + 2·kv) · head_dim, hidden]`.
    qkv_proj: PackedLinear,
    o_proj: PackedLinear,
    /// o_proj's bias when added after the all-reduce (tensor parallelism).
    o_bias: Option<Vec<f32>>,
    /// Qwen3's per-head norms.
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

/// MLP weights of one layer (`mlp.*`).
struct Mlp {
    /// `gate_proj` and `up_proj` stacked: `[2 · intermediate, hidden]`.
    gate_up_proj: PackedLinear,
    down_proj: PackedLinear,
    /// down_proj's bias when added after the all-reduce (tensor parallelism).
    down_bias: Option<Vec<f32>>,
}

/// One decoder layer (`model.layers.{i}.*`).
struct DecoderLayer {
    input_layernorm: Vec<f32>,
    self_attn: SelfAttn,
    post_attention_layernorm: Vec<f32>,
    mlp: Mlp,
    sliding_window: Option<usize>,
}

/// A loaded Llama-family model whose hidden width is the dim `H`
/// (`Hidden<N>` in a static job, `usize` when it comes from `config.json`).
pub struct Llama<H: Dim = usize> {
    config: LlamaConfig,
    hidden: H,
    dtype: DType,
    embed_tokens: frame::Embedding,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    inv_freq: Vec<f32>,
    /// How this rank's share of heads and widths was cut.
    plan: TpPlan,
    /// The rank's communicator; `None` for a single rank.
    comm: Option<Arc<dyn Collective<Buf = [f32]>>>,
}

/// Reusable activations of one forward, sized by the batch.
struct Activations {
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    /// A row-parallel layer's partial output, before the all-reduce.
    partial: Vec<f32>,
}

fn inv_freq(c: &LlamaConfig) -> Vec<f32> {
    let d = c.head_dim;
    let base: Vec<f32> = (0..d / 2).map(|i| 1.0 / c.rope_theta.powf((2 * i) as f32 / d as f32)).collect();
    match c.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

impl<H: Dim + Default> Llama<H> {
    /// Loads `config.json` and the safetensors weights from a checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ckpt)
    }

    /// Builds the model from a parsed config and an opened checkpoint,
    /// checking the config's hidden size against `H`.
    pub fn from_checkpoint(config: LlamaConfig, ckpt: &Checkpoint) -> Result<Self, ModelError> {
        let plan = TpPlan::new(&config, 1).map_err(ModelError::Parallel)?;
        Self::from_checkpoint_rank(config, ckpt, plan, None)
    }

    /// Builds tensor-parallel rank `comm.rank()` of `plan.size`: it reads only
    /// its own rows of q/k/v and gate/up and its own columns of o/down from
    /// the mapped checkpoint. With `comm = None`, the whole model (`plan.size = 1`).
    pub fn from_checkpoint_rank(
        config: LlamaConfig,
        ckpt: &Checkpoint,
        plan: TpPlan,
        comm: Option<Arc<dyn Collective<Buf = [f32]>>>,
    ) -> Result<Self, ModelError> {
        let rank = comm.as_ref().map_or(0, |c| c.rank());
        let _span = info_span!("load", arch = config.arch.name(), layers = config.num_layers, rank).entered();
        let hidden: H = dim_from_size("config.json hidden_size", "hidden", config.hidden_size)?;
        let c = &config;
        let (h, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_out, kv_out) = (c.num_heads * hd, c.num_kv_heads * hd);
        // This rank's rows of the column-parallel weights and columns of the row-parallel ones.
        let q_rows = rank * plan.heads * hd..(rank + 1) * plan.heads * hd;
        let kv0 = plan.kv_head0(c, rank);
        let kv_rows = kv0 * hd..(kv0 + plan.kv_heads) * hd;
        let i_rows = rank * plan.intermediate..(rank + 1) * plan.intermediate;
        let embed_tokens = frame::Embedding::read(ckpt, c.vocab_size, h)?;
        let dtype = embed_tokens.dtype();
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let w = |name: &str, shape: &[usize]| ckpt.read_f32(&format!("{p}.{name}"), shape);
            let rows = |name: &str, shape: &[usize], r: &std::ops::Range<usize>| {
                let cols = if shape.len() == 2 { 0..shape[1] } else { 0..1 };
                ckpt.read_f32_block(&format!("{p}.{name}"), shape, r.clone(), cols)
            };
            // Weights as stored (bf16 stays bf16, decoded per tile; f32/f16 as f32).
            let lin = |name: &str, shape: [usize; 2], r: std::ops::Range<usize>, cols: std::ops::Range<usize>| {
                ckpt.read_linear(&format!("{p}.{name}"), shape, r, cols, WeightFormat::Plain)
            };
            let qkv = LinearWeight::stack(vec![
                lin("self_attn.q_proj", [q_out, h], q_rows.clone(), 0..h)?,
                lin("self_attn.k_proj", [kv_out, h], kv_rows.clone(), 0..h)?,
                lin("self_attn.v_proj", [kv_out, h], kv_rows.clone(), 0..h)?,
            ]);
            let qkv_bias = if c.qkv_bias {
                let mut b = rows("self_attn.q_proj.bias", &[q_out], &q_rows)?;
                b.extend(rows("self_attn.k_proj.bias", &[kv_out], &kv_rows)?);
                b.extend(rows("self_attn.v_proj.bias", &[kv_out], &kv_rows)?);
                Some(b)
            } else {
                None
            };
            let o_bias = if c.o_bias { Some(w("self_attn.o_proj.bias", &[h])?) } else { None };
            let (q_norm, k_norm) = if c.qk_norm {
                (Some(w("self_attn.q_norm.weight", &[hd])?), Some(w("self_attn.k_norm.weight", &[hd])?))
            } else {
                (None, None)
            };
            let gate_up = LinearWeight::stack(vec![
                lin("mlp.gate_proj", [i, h], i_rows.clone(), 0..h)?,
                lin("mlp.up_proj", [i, h], i_rows.clone(), 0..h)?,
            ]);
            let (gate_up_bias, down_bias) = if c.mlp_bias {
                let mut b = rows("mlp.gate_proj.bias", &[i], &i_rows)?;
                b.extend(rows("mlp.up_proj.bias", &[i], &i_rows)?);
                (Some(b), Some(w("mlp.down_proj.bias", &[h])?))
            } else {
                (None, None)
            };
            // One rank keeps its biases inside the GEMM; with several, a row-parallel
            // bias is added once, after the all-reduce.
            let single = plan.size == 1;
            let o_proj = lin("self_attn.o_proj", [h, q_out], 0..h, q_rows.clone())?;
            let down_proj = lin("mlp.down_proj", [h, i], 0..h, i_rows.clone())?;
            layers.push(DecoderLayer {
                input_layernorm: w("input_layernorm.weight", &[h])?,
                self_attn: SelfAttn {
                    qkv_proj: PackedLinear::from_weight(qkv, qkv_bias),
                    o_proj: PackedLinear::from_weight(o_proj, if single { o_bias.clone() } else { None }),
                    o_bias: if single { None } else { o_bias },
                    q_norm,
                    k_norm,
                },
                post_attention_layernorm: w("post_attention_layernorm.weight", &[h])?,
                mlp: Mlp {
                    gate_up_proj: PackedLinear::from_weight(gate_up, gate_up_bias),
                    down_proj: PackedLinear::from_weight(down_proj, if single { down_bias.clone() } else { None }),
                    down_bias: if single { None } else { down_bias },
                },
                sliding_window: c.sliding_windows[l],
            });
        }
        let norm = ckpt.read_f32("model.norm.weight", &[h])?;
        let inv_freq = inv_freq(c);
        Ok(Llama { config, hidden, dtype, embed_tokens, layers, norm, inv_freq, plan, comm })
    }
}

impl<H: Dim> Llama<H> {
    /// The normalised config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }
    /// The hidden dim.
    pub fn hidden(&self) -> H {
        self.hidden
    }
    /// The dtype the checkpoint stores its weights in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Checks a batch against the model: token ids in the vocabulary, no empty
    /// segment, no position past `max_position_embeddings`.
    pub fn check_batch(&self, batch: &PackedBatch) -> Result<(), ModelError> {
        frame::check_batch(batch, self.config.vocab_size, self.config.max_position_embeddings)
    }

    /// Bytes of memory the weights hold (bf16 weights as bf16).
    pub fn resident_bytes(&self) -> usize {
        let v = |x: &[f32]| x.len() * 4;
        let o = |x: &Option<Vec<f32>>| x.as_deref().map_or(0, v);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let (a, m) = (&l.self_attn, &l.mlp);
                a.qkv_proj.resident_bytes()
                    + a.o_proj.resident_bytes()
                    + o(&a.o_bias)
                    + o(&a.q_norm)
                    + o(&a.k_norm)
                    + m.gate_up_proj.resident_bytes()
                    + m.down_proj.resident_bytes()
                    + o(&m.down_bias)
                    + v(&l.input_layernorm)
                    + v(&l.post_attention_layernorm)
            })
            .sum();
        self.embed_tokens.resident_bytes() + layers + v(&self.norm) + v(&self.inv_freq)
    }

    /// Runs the decoder over a packed batch of whole samples and returns the
    /// captured states `[L, T_total, H]`, layers in the capture set's order.
    /// Layers past the deepest capture point are not run.
    pub fn forward<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
    ) -> Result<CapturedStates<L, H>, ModelError> {
        self.forward_step(batch, captures, &mut KvCache::default())
    }

    /// [`forward`](Self::forward) for batches that hold chunks of samples:
    /// a segment with `pos0 > 0` attends to the keys/values its sample's
    /// earlier chunks left in `cache`; a segment with `keep` leaves its own
    /// there for the next chunk. The states of a token do not depend on how
    /// its sample was chunked or packed (bitwise).
    pub fn forward_step<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
    ) -> Result<CapturedStates<L, H>, ModelError> {
        Ok(self.forward_rank(batch, captures, cache, true)?.expect("capturing forward returns states"))
    }

    /// The forward of one tensor-parallel rank: every rank runs it in step (the
    /// all-reduces need all of them); only a capturing rank fills and returns
    /// the states, the others return `None` without allocating them.
    pub fn forward_rank<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
        capture: bool,
    ) -> Result<Option<CapturedStates<L, H>>, ModelError> {
        let c = &self.config;
        self.check_batch(batch)?;
        let (t, h) = (batch.num_tokens(), c.hidden_size);
        let mut caps = Captures::new(captures, c.num_layers, t, self.hidden, capture)?;
        cache.check(batch)?;
        let _span = info_span!("forward", tokens = batch.num_tokens(), samples = batch.num_samples()).entered();
        let mut x = self.embed_tokens.embed(batch);
        let (cos, sin) = frame::rope_table(&self.inv_freq, batch.max_position(), 1.0);
        let mut act = Activations {
            normed: vec![0f32; t * h],
            qkv: vec![0f32; t * self.qkv_width()],
            attn: vec![0f32; t * self.plan.heads * c.head_dim],
            gate_up: vec![0f32; t * 2 * self.plan.intermediate],
            act: vec![0f32; t * self.plan.intermediate],
            partial: Vec::new(),
        };
        // The residual stream is whole on every rank (row-parallel outputs are
        // all-reduced), so a capture reads full `[T, H]` states, never a shard.
        for (k, layer) in self.layers.iter().enumerate().take(caps.depth) {
            caps.record(Tap::Residual(k), &x);
            let _s = debug_span!("layer", k).entered();
            self.layer_forward(k, layer, batch, &cos, &sin, &mut x, &mut act, cache);
        }
        cache.retire(batch);
        Ok(caps.finish(&x, &self.norm, c.rms_norm_eps, &mut act.normed))
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        k: usize,
        layer: &DecoderLayer,
        batch: &PackedBatch,
        cos: &[f32],
        sin: &[f32],
        x: &mut [f32],
        act: &mut Activations,
        cache: &mut KvCache,
    ) {
        let c = &self.config;
        let t = batch.num_tokens();
        let (nh, nkv, hd) = (self.plan.heads, self.plan.kv_heads, c.head_dim);
        let half = hd / 2;

        rms_norm(x, &layer.input_layernorm, c.rms_norm_eps, &mut act.normed);
        layer.self_attn.qkv_proj.forward(&act.normed, t, &mut act.qkv, false);
        // q/k norm (Qwen3) then RoPE at each token's position within its sample.
        let stride = self.qkv_width();
        for (s, seg) in batch.segments().iter().enumerate() {
            let r = batch.range(s);
            for (i, row) in act.qkv[r.start * stride..r.end * stride].chunks_exact_mut(stride).enumerate() {
                let pos = seg.pos0 + i;
                let (qk, _v) = row.split_at_mut((nh + nkv) * hd);
                let (q, k) = qk.split_at_mut(nh * hd);
                if let (Some(qn), Some(kn)) = (&layer.self_attn.q_norm, &layer.self_attn.k_norm) {
                    rms_norm_heads_inplace(q, qn, c.rms_norm_eps);
                    rms_norm_heads_inplace(k, kn, c.rms_norm_eps);
                }
                let (cs, sn) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
                qk.chunks_exact_mut(hd).for_each(|head| rope_head(head, cs, sn));
            }
        }
        let shape = AttnShape {
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            v_dim: hd,
            window: layer.sliding_window,
            scale: (hd as f32).powf(-0.5),
        };
        // Chunks of longer samples add their keys/values to the cache and read
        // all earlier positions from it; whole samples read their own rows.
        let kv_width = nkv * hd;
        for (s, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            let entry = cache.layer_mut(seg.key, k);
            for row in act.qkv[batch.range(s).start * stride..batch.range(s).end * stride].chunks_exact(stride) {
                entry.k.extend_from_slice(&row[nh * hd..nh * hd + kv_width]);
                entry.v.extend_from_slice(&row[(nh + nkv) * hd..]);
            }
        }
        let segments: Vec<AttnSegment> = batch
            .segments()
            .iter()
            .enumerate()
            .map(|(s, seg)| {
                let rows = batch.range(s);
                let kv = if seg.uses_cache() {
                    let e = cache.layer(seg.key, k);
                    KvRef { k: &e.k, v: &e.v, stride: kv_width, v_stride: kv_width }
                } else {
                    let base = rows.start * stride;
                    KvRef {
                        k: &act.qkv[base + nh * hd..],
                        v: &act.qkv[base + (nh + nkv) * hd..],
                        stride,
                        v_stride: stride,
                    }
                };
                AttnSegment { rows, pos0: seg.pos0, kv }
            })
            .collect();
        varlen_attention(&act.qkv, stride, &segments, shape, &mut act.attn);
        // x += attn · o_projᵀ (fused into the GEMM on one rank).
        frame::row_parallel(
            self.comm.as_deref(),
            &layer.self_attn.o_proj,
            layer.self_attn.o_bias.as_deref(),
            &act.attn,
            t,
            x,
            &mut act.partial,
        );

        rms_norm(x, &layer.post_attention_layernorm, c.rms_norm_eps, &mut act.normed);
        layer.mlp.gate_up_proj.forward(&act.normed, t, &mut act.gate_up, false);
        swiglu(&act.gate_up, self.plan.intermediate, &mut act.act);
        frame::row_parallel(
            self.comm.as_deref(),
            &layer.mlp.down_proj,
            layer.mlp.down_bias.as_deref(),
            &act.act,
            t,
            x,
            &mut act.partial,
        );
    }

    /// Width of this rank's fused q/k/v output.
    fn qkv_width(&self) -> usize {
        (self.plan.heads + 2 * self.plan.kv_heads) * self.config.head_dim
    }
}
