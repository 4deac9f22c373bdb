"""`python -m kora_trainer.reference_engine --model-path DIR [--port N] ...`: serve one reference engine."""

from kora_trainer.reference_engine.server import main

if __name__ == "__main__":
    main()
