"""One vLLM engine on CPU in a process of its own, for test_vllm.py: generates greedily from the prompts it is
given, with the kvfs KV connector if a kvfs client config is given, and prints one JSON line per prompt (the
output token ids and how many prompt tokens came from a cache). vLLM starts its engine core in a spawned process,
which re-imports this file: hence a script with a main guard rather than code run with ``-c``."""

from __future__ import annotations

import argparse
import json
import logging

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--kvfs-config")
    parser.add_argument("--namespace")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    transfer = None
    if args.kvfs_config:
        transfer = KVTransferConfig(
            kv_connector="KvfsKVConnector", kv_connector_module_path="kvfs.kvclient.adapters.vllm", kv_role="kv_both",
            kv_connector_extra_config={"config": args.kvfs_config, "namespace": args.namespace})
    llm = LLM(model=args.model, dtype="float32", max_model_len=512, block_size=32, enforce_eager=True, max_num_seqs=4,
              seed=0, kv_transfer_config=transfer, enable_prefix_caching=transfer is not None)
    for prompt in args.prompt:  # one at a time: each later prompt may find the earlier ones' blocks
        (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        result = {"prompt_tokens": len(out.prompt_token_ids), "output": list(out.outputs[0].token_ids),
                  "cached_tokens": out.num_cached_tokens}
        print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
