"""Mamba2 SSD: the chunked scan for prefill chunks and the single-step update for decode."""

from pallas_kernels.ssm_scan.reference import ssd_chunk_scan, ssm_decode_step

__all__ = ["ssd_chunk_scan", "ssm_decode_step"]
