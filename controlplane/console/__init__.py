"""A read-only web console over a running control plane (``cachettl serve --console``).

It runs in the server's process and event loop and reads the same ``ControlPlane`` (models,
store) and the same token cache as the gRPC services: a tenant's token shows that tenant's
statistics and the shared models published to it, the console's admin token every tenant's.
Nothing here writes to the store or the models.

- :mod:`controlplane.console.host`: :class:`~controlplane.console.host.Console`, started
  beside a :class:`~controlplane.rpc.server.ControlPlaneServer` (uvicorn on the same loop);
- :mod:`controlplane.console.app`: the Starlette routes, pages and security headers;
- :mod:`controlplane.console.sessions`: the login form, sessions and who may see what;
- :mod:`controlplane.console.pages`: each page's parameters and who may see its tenant;
- :mod:`controlplane.console.views` (tools, a tool) and :mod:`controlplane.console.overview`
  (tenants, shared models, workload, engines): the pages' data, paged and bounded;
- :mod:`controlplane.console.watch`: η and T over time, moves told per engine;
- :mod:`controlplane.console.cli`: the ``serve`` flags (no web imports) and
  ``cachettl bench console``.

This package imports Starlette and uvicorn (the ``console`` extra) only in ``app`` and
``host``; ``cli`` stays light so that ``cachettl --help`` works without them.
"""
