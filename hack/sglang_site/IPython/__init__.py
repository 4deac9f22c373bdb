"""A stand-in for IPython on the GPU device (hack/sglang_carry.sh leaves the real one out: jedi alone is 33 MB).
SGLang 0.5.17's sglang/utils.py imports IPython.display for notebook helpers the server never calls, and Ray's
logging asks get_ipython() whether it runs in a notebook: it does not."""


def get_ipython() -> None:
    return None
