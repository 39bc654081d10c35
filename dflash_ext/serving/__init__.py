"""Serving DFlash in an engine: vLLM's plugin (:mod:`.vllm_plugin`, registered through the
``vllm.general_plugins`` entry point) and the drafter model it registers
(:mod:`.vllm_model`, imported by vLLM only). Nothing here imports vLLM unless vLLM calls it."""
