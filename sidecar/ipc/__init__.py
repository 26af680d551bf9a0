"""CUDA IPC regions on the server side: opening clients' memory and events (``device``), the table that
bounds-checks every use and defers closing while chunks use a region (``regions``), and the engine-thread
reads/writes (``io``)."""
