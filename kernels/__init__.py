"""Numerics shared by serving and trainer: batch-invariant ops and MoE router capture/replay."""
