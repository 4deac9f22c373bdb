"""`python -m kora_engine.lm --model-path DIR [--port N] ...`: serve one reference engine."""

from kora_engine.lm.server import main

if __name__ == "__main__":
    main()
