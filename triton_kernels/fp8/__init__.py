"""DeepSeek-V3.2's FP8 cache entry (``mqnc.model.kv_format``): ``quant`` quantizes rows to
656-byte entries and back (kernels and public functions); ``cache`` is the attention kernels'
host side of an FP8 pool (recognising it, its layout, the values of the entries a call
attends)."""
