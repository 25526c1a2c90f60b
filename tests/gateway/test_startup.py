"""What the gateway does at start so that no producer's batch waits for it later."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_start_imports_the_records_accelerator_before_any_batch(tmp_path: Path) -> None:
    # In a fresh interpreter: this test process has numpy imported already.
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from headgate.config import GatewayConfig
        from headgate.gateway import Gateway

        async def main() -> None:
            gateway = Gateway(GatewayConfig(data_dir={str(tmp_path)!r}, listen=("127.0.0.1", 0)))
            before = "numpy" in sys.modules
            await gateway.start()
            after = "numpy" in sys.modules
            await gateway.stop()
            print(before, after)

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


def test_serving_imports_no_spark_pandas_or_rich(tmp_path: Path) -> None:
    # Each of them costs start-up time (hundreds of ms for pyspark), and
    # the gateway needs none of them to serve.
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        import headgate.cli
        from headgate.config import GatewayConfig
        from headgate.gateway import Gateway

        async def main() -> None:
            gateway = Gateway(GatewayConfig(data_dir={str(tmp_path)!r}, listen=("127.0.0.1", 0)))
            await gateway.start()
            gateway.stream("s")
            await gateway.stop()

        asyncio.run(main())
        heavy = ("pyspark", "pandas", "rich", "pyarrow", "py4j")
        print(sorted(name for name in sys.modules if name.split(".")[0] in heavy))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_serving_without_metrics_imports_neither_prometheus_nor_package_metadata(
    tmp_path: Path,
) -> None:
    # prometheus-client is needed only with --metrics, and importlib.metadata
    # (with the email parser) only for --version: together about 100 ms of a
    # start on a busy machine.
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        import headgate.cli
        from headgate.config import GatewayConfig
        from headgate.gateway import Gateway

        async def main() -> None:
            gateway = Gateway(GatewayConfig(data_dir={str(tmp_path)!r}, listen=("127.0.0.1", 0)))
            await gateway.start()
            gateway.stream("s")
            await gateway.stop()

        asyncio.run(main())
        heavy = ("prometheus_client", "importlib.metadata", "email")
        print(sorted(n for n in sys.modules if n in heavy or n.split(".")[0] in heavy))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]
