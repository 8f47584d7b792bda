"""The online-softmax merge of partials (§3.2, §3.3): ``partials`` holds the kernel, its
launcher and the public ``merge_partials`` / ``merge_partials_into`` (re-exported by
:mod:`mqnc.triton_kernels`) and the LSE base conversions."""
