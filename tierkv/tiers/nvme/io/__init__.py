"""Block IO of the nvme tier: io_uring (`_uring`), a thread pool (`_threads`), aligned buffers."""
