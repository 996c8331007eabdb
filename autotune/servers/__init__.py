"""Server processes: the one owner of every process autotune starts (``process``), the
vLLM launcher and attached servers (``vllm``), and what a server reports about itself
(``telemetry``: /metrics and the GPUs)."""
