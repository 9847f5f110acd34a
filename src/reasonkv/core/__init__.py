"""The transformers integration and the policy math beneath it.

`core.policy` is pure torch (no transformers import); `cache`, `layer`, `attention` and
`models` plug it into transformers."""
