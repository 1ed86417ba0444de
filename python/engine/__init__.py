"""The engine core: requests as token ids, the scheduler, the KV cache manager."""
