"""The one foundation under relax_gym's four HTTP servers and their clients.

`relax-gym serve` (the engine), `relax-gym env-server`, the agent proxy and a run's control API all stand on it:

- `guard`: what stands between a server and the network: the bearer key (except on a server's open routes), the
  body cap and the read deadline, answered before a byte of the body is parsed;
- `bounds`: each server's body cap, read deadline and connection cap, in one place;
- `errors`: the one error shape, `{"error": {"message", "code"}}`, and the one validation handler (400);
- `serve`: uvicorn inside a running event loop, on a socket bound before it starts (no port race);
- `keys`: one key per service, where each is read from and how a generated one is announced;
- `address`: whether a host is this machine, and a server's URL;
- `client`: the bearer header, the error reader and the retry backoff, for every client of these servers.

Each module imports only its own third-party library (a client never pays for uvicorn), and nothing of relax_gym
but `relax_gym.errors`.
"""
