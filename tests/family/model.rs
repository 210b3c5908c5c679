//! The test family's decoder layer: the Llama family's
//! ([`crate::model::llama`]), weights and names alike, with one quirk,
//! Granite's factor `s` (`residual_multiplier`) on each residual update:
//! `x += s·self_attn(input_layernorm(x))`, then
//! `x += s·mlp(post_attention_layernorm(x))`. A module of `model` built only
//! with the `test-family` feature (the crate's tests turn it on), declared
//! by its row of the family table, `crate::families`: aliases, `AnyConfig`,
//! parsing, dispatch and TP come from the row.

use crate::backend::{Backend, LayerState, Tensor};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::{ConfigError, ScaledLlamaConfig};
use crate::model::decoder::{Block, Frame, LayerStep};
use crate::model::llama::{DecoderLayer as Llama, Scratch};
use crate::model::shard::Split;
use crate::model::ModelError;
use crate::shape::Dim;

/// One decoder layer (`model.layers.{i}.*`, as a Llama's).
pub struct DecoderLayer<B: Backend> {
    llama: Llama<B>,
    /// `residual_multiplier`.
    s: f32,
}

impl<B: Backend> DecoderLayer<B> {
    /// `x += s·f`, where `update` is Llama's `x += f`: Llama's update runs as
    /// it is, and `f` is taken back out as `(x + f) − x` (one rounding more
    /// than Llama's own add) and scaled, with backend ops only.
    fn scaled<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, update: impl FnOnce(&mut Tensor<B, H>)) {
        // s = 1 is Llama's layer, bit for bit.
        if self.s == 1.0 {
            update(x);
            return;
        }
        let mut before = Tensor::zeros(b, x.rows(), x.width());
        b.add(&mut before, x);
        update(x);
        b.scale(&mut before, -1.0);
        b.add(x, &before); // f
        b.scale(x, self.s);
        b.scale(&mut before, -1.0);
        b.add(x, &before);
    }
}

impl<B: Backend> Block<B> for DecoderLayer<B> {
    type Config = ScaledLlamaConfig;
    type Scratch<H: Dim> = Scratch<B, H>;

    fn parse_config(text: &str) -> Result<ScaledLlamaConfig, ConfigError> {
        ScaledLlamaConfig::from_json(text)
    }

    fn frame(c: &ScaledLlamaConfig) -> Frame {
        Frame { info: c.info(), ..<Llama<B> as Block<B>>::frame(&c.llama) }
    }

    fn splits(c: &ScaledLlamaConfig) -> Vec<Split> {
        <Llama<B> as Block<B>>::splits(&c.llama)
    }

    fn quantization(c: &ScaledLlamaConfig) -> Option<String> {
        <Llama<B> as Block<B>>::quantization(&c.llama)
    }

    fn load(b: &B, c: &ScaledLlamaConfig, ckpt: &Checkpoint, l: usize) -> Result<Self, ModelError> {
        Ok(DecoderLayer { llama: Llama::load(b, &c.llama, ckpt, l)?, s: c.residual_multiplier })
    }

    fn scratch<H: Dim>(b: &B, c: &ScaledLlamaConfig, t: usize, hidden: H) -> Scratch<B, H> {
        <Llama<B> as Block<B>>::scratch(b, &c.llama, t, hidden)
    }

    fn forward<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, at: LayerStep<'_, B, Scratch<B, H>>) {
        let LayerStep { step, scratch: s, state, index } = at;
        let kv = LayerState::new(&mut state.kv, index);
        self.scaled(b, x, |x| self.llama.attention_add(b, x, step, s, kv));
        self.scaled(b, x, |x| self.llama.ffn_add(b, x, s));
    }

    fn weight_bytes(&self) -> usize {
        self.llama.weight_bytes()
    }
}
