"""``python -m code2wav.client.vllm_omni``: print the installed deploy overlay's path, for
``vllm serve MODEL --omni --deploy-config "$(python -m code2wav.client.vllm_omni)"``."""

from . import DEPLOY_CONFIG

if __name__ == "__main__":
    print(DEPLOY_CONFIG)
