"""Network addresses."""
import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
