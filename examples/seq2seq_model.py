"""A small Transformer encoder-decoder in Flax Linen, written as published models are.

It follows the layout of the Flax WMT example (``examples/wmt/models.py``) and
T5X-style code: a frozen config whose ``dtype`` (float32 by default) every
layer receives, pre-LayerNorm blocks, sinusoidal position encodings, dropout,
and ONE token embedding shared by the encoder input, the decoder input and,
through ``nn.Embed.attend``, the output projection (tied weights).

Nothing here knows about mixed precision: this file is meant to be used as it
is, the way one would import a model from someone else's repository.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters. Frozen, so that modules holding it stay hashable."""

  vocab_size: int = 257
  emb_dim: int = 64
  num_heads: int = 2
  num_layers: int = 2
  mlp_dim: int = 128
  max_len: int = 64
  dropout_rate: float = 0.1
  dtype: Any = jnp.float32


def sinusoidal_table(max_len: int, features: int) -> np.ndarray:
  """The fixed position encodings of "Attention Is All You Need"."""
  position = np.arange(max_len)[:, None]
  div_term = np.exp(np.arange(0, features, 2) * -(np.log(10000.0) / features))
  table = np.zeros((max_len, features), np.float32)
  table[:, 0::2] = np.sin(position * div_term)
  table[:, 1::2] = np.cos(position * div_term)
  return table


class AddPositionEmbs(nn.Module):
  """Adds fixed sinusoidal position encodings (no parameters)."""

  config: Config

  @nn.compact
  def __call__(self, inputs):
    length = inputs.shape[1]
    table = jnp.asarray(sinusoidal_table(self.config.max_len, inputs.shape[-1]))
    return inputs + table[None, :length, :]


class MlpBlock(nn.Module):
  """Dense -> gelu -> dropout -> Dense -> dropout."""

  config: Config

  @nn.compact
  def __call__(self, inputs, *, deterministic: bool):
    cfg = self.config
    x = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype)(inputs)
    x = nn.gelu(x)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
    x = nn.Dense(inputs.shape[-1], dtype=cfg.dtype)(x)
    return nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)


class EncoderBlock(nn.Module):
  """Pre-LayerNorm self-attention and MLP, each with a residual connection."""

  config: Config

  @nn.compact
  def __call__(self, inputs, *, deterministic: bool):
    cfg = self.config
    x = nn.LayerNorm(dtype=cfg.dtype)(inputs)
    x = nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, qkv_features=cfg.emb_dim, dtype=cfg.dtype,
        deterministic=deterministic)(x, x)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
    x = x + inputs
    y = nn.LayerNorm(dtype=cfg.dtype)(x)
    return x + MlpBlock(cfg)(y, deterministic=deterministic)


class DecoderBlock(nn.Module):
  """Causal self-attention, cross-attention on the encoder output, MLP."""

  config: Config

  @nn.compact
  def __call__(self, targets, encoded, *, decoder_mask, deterministic: bool):
    cfg = self.config
    x = nn.LayerNorm(dtype=cfg.dtype)(targets)
    x = nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, qkv_features=cfg.emb_dim, dtype=cfg.dtype,
        deterministic=deterministic, name="self_attention")(x, x, mask=decoder_mask)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
    x = x + targets
    y = nn.LayerNorm(dtype=cfg.dtype)(x)
    y = nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, qkv_features=cfg.emb_dim, dtype=cfg.dtype,
        deterministic=deterministic, name="cross_attention")(y, encoded)
    y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=deterministic)
    y = y + x
    z = nn.LayerNorm(dtype=cfg.dtype)(y)
    return y + MlpBlock(cfg)(z, deterministic=deterministic)


class Encoder(nn.Module):
  """Embeds the source with the shared embedding and encodes it."""

  config: Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, inputs, *, deterministic: bool):
    cfg = self.config
    x = self.shared_embedding(inputs.astype("int32"))
    x = AddPositionEmbs(cfg, name="posembed_input")(x)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
    x = x.astype(cfg.dtype)
    for i in range(cfg.num_layers):
      x = EncoderBlock(cfg, name=f"encoderblock_{i}")(x, deterministic=deterministic)
    return nn.LayerNorm(dtype=cfg.dtype, name="encoder_norm")(x)


class Decoder(nn.Module):
  """Decodes shifted targets; logits through the shared embedding (tied)."""

  config: Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoded, targets_in, *, deterministic: bool):
    cfg = self.config
    y = self.shared_embedding(targets_in.astype("int32"))
    y = AddPositionEmbs(cfg, name="posembed_output")(y)
    y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=deterministic)
    y = y.astype(cfg.dtype)
    decoder_mask = nn.make_causal_mask(targets_in, dtype=cfg.dtype)
    for i in range(cfg.num_layers):
      y = DecoderBlock(cfg, name=f"decoderblock_{i}")(
          y, encoded, decoder_mask=decoder_mask, deterministic=deterministic)
    y = nn.LayerNorm(dtype=cfg.dtype, name="decoder_norm")(y)
    # As in the WMT example: the tied projection, in float32, scaled.
    logits = self.shared_embedding.attend(y.astype(jnp.float32))
    return logits / jnp.sqrt(y.shape[-1])


class Seq2Seq(nn.Module):
  """Transformer encoder-decoder with one shared input/output embedding."""

  config: Config

  def setup(self):
    cfg = self.config
    self.shared_embedding = nn.Embed(
        num_embeddings=cfg.vocab_size, features=cfg.emb_dim, dtype=cfg.dtype,
        embedding_init=nn.initializers.normal(stddev=1.0))
    self.encoder = Encoder(cfg, shared_embedding=self.shared_embedding)
    self.decoder = Decoder(cfg, shared_embedding=self.shared_embedding)

  def __call__(self, src, tgt_in, *, train: bool):
    """Logits ``[batch, len(tgt_in), vocab_size]`` for teacher-forced targets."""
    encoded = self.encoder(src, deterministic=not train)
    return self.decoder(encoded, tgt_in, deterministic=not train)
