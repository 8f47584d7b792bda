"""The delta-rotation splice and the query rotation (§2.2, §3.2): ``rotate`` holds the one-launch
splice kernel, the query rotation and their public functions (re-exported by
:mod:`mqnc.triton_kernels`)."""
