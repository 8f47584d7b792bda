"""The device route's kernels (§3.1-§3.3, §6.3): no host call per request.

- ``put``: the requester's put of a routed request into a holder's inbox slot;
- ``holder_loop``: the holder as a resident kernel serving route requests;
- ``wait_merge``: the requester's wait for the replies and their merge;
- ``words``: the header, reply and status words the three share;
- ``nvshmem_device``: the NVSHMEM device calls (the ``nvshmem`` backend).

The host side (buffers, backends) is :mod:`mqnc.transport.device_route`."""
