"""Paged variable-length attention: one contract, several implementations."""

from kernels.metadata import AttentionMetadata
from kernels.reference import paged_attention, write_kv

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]
