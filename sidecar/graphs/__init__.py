"""CUDA graph mechanism and policy: the bucket plan (policy) and the capture/replay manager (mechanism)."""
