"""The attention templates: flash-decoding (one query row) and flash-attention prefill (mma.sync), each with a CPU
variant, its knobs, and the role analysis that finds Q, K, V, mask and scale in a fused attention kernel."""
