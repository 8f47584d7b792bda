"""Other libraries' calling conventions over mqnc's kernels: adapters, not copies of kernels.
``flashmla``: FlashMLA's ``flash_mla_with_kvcache`` layout (dense and sparse, FP8 caches);
``flashinfer``: FlashInfer's MLA paged wrapper and cascade merges."""
