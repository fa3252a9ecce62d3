"""The guess environment's FastAPI app (OpenEnv's HTTP + WebSocket server):

    uvicorn guess_env.server.app:app --host 127.0.0.1 --port 8000   # from examples/openenv
    python -m guess_env.server.app --port 8000

arl starts it itself (``env.kwargs.server: guess_env.server.app:app``) with the OpenEnv venv's
python; up to 64 concurrent sessions, one per live arl environment (``env.pool_size``)."""
from openenv.core.env_server.http_server import create_app

try:
    from ..models import GuessAction, GuessObservation
    from .guess_environment import GuessEnvironment
except ImportError:
    from models import GuessAction, GuessObservation
    from server.guess_environment import GuessEnvironment

app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess_env", max_concurrent_envs=64)


def main():
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
