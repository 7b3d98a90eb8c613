"""Speculative decoding with the model's own MTP modules: drafting, verification, SSM
rollback, and the gate that decides per tick whether it pays."""
