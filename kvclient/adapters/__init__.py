"""Inference-engine adapters over kvclient. Each module imports its engine and is loaded only by that engine
(from its plugin configuration), so ``import kvfs.kvclient`` never pulls in an engine."""
