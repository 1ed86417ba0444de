//! Parsing a replica's base URL (`--replica`) and a DNS name to discover (`--discover-dns`).

use std::net::SocketAddr;

use axum::http::uri::{Scheme, Uri};
use thiserror::Error;

use crate::policies::ReplicaId;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ReplicaUrlError {
    #[error("`{0}` is not a URL (expected http://HOST:PORT)")]
    NotAUrl(String),
    #[error(
        "`{0}`: only http:// replicas are supported (the router speaks plain HTTP to replicas)"
    )]
    NotHttp(String),
    #[error("`{0}` has no host (expected http://HOST:PORT)")]
    NoHost(String),
    #[error("`{0}` must be a plain base URL, http://HOST:PORT (no user, path or query)")]
    NotBase(String),
    #[error("`{0}` has a port that is not a number from 1 to 65535")]
    BadPort(String),
    #[error("`{0}` is not NAME:PORT")]
    NotNamePort(String),
}

/// `http://host:port` (a trailing `/` allowed) as the replica's id; the port defaults to 80.
pub fn parse_replica_url(text: &str) -> Result<ReplicaId, ReplicaUrlError> {
    let uri: Uri = text
        .parse()
        .map_err(|_| ReplicaUrlError::NotAUrl(text.to_string()))?;
    match uri.scheme() {
        Some(scheme) if *scheme == Scheme::HTTP => {}
        Some(_) => return Err(ReplicaUrlError::NotHttp(text.to_string())),
        None => return Err(ReplicaUrlError::NotAUrl(text.to_string())),
    }
    let authority = uri
        .authority()
        .filter(|authority| !authority.host().is_empty())
        .ok_or_else(|| ReplicaUrlError::NoHost(text.to_string()))?;
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() || authority.as_str().contains('@')
    {
        return Err(ReplicaUrlError::NotBase(text.to_string()));
    }
    // Uri keeps an out-of-range port in the text but reports none, so read it from the text.
    let port = match authority.as_str()[authority.host().len()..].strip_prefix(':') {
        None => 80,
        Some(port) => match port.parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => return Err(ReplicaUrlError::BadPort(text.to_string())),
        },
    };
    Ok(ReplicaId(
        format!("http://{}:{port}", authority.host()).into(),
    ))
}

/// `NAME:PORT` for DNS discovery.
pub fn parse_dns_target(text: &str) -> Result<(String, u16), ReplicaUrlError> {
    let error = || ReplicaUrlError::NotNamePort(text.to_string());
    let (name, port) = text.rsplit_once(':').ok_or_else(error)?;
    let port: u16 = port.parse().map_err(|_| error())?;
    if name.is_empty() || name.contains('/') || port == 0 {
        return Err(error());
    }
    Ok((name.to_string(), port))
}

/// The replica id of one resolved address (IPv6 in brackets).
pub fn replica_id_of(address: SocketAddr) -> ReplicaId {
    ReplicaId(format!("http://{address}").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_become_ids_with_their_port() {
        let id = |text| parse_replica_url(text).unwrap().0.to_string();
        assert_eq!(id("http://10.0.0.1:8001"), "http://10.0.0.1:8001");
        assert_eq!(id("http://replica-a:8001/"), "http://replica-a:8001");
        assert_eq!(id("http://replica-a"), "http://replica-a:80");
        assert_eq!(id("http://[::1]:9000"), "http://[::1]:9000");
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        assert!(matches!(
            parse_replica_url("not a url"),
            Err(ReplicaUrlError::NotAUrl(_))
        ));
        assert!(matches!(
            parse_replica_url("localhost:8000"),
            Err(ReplicaUrlError::NotAUrl(_) | ReplicaUrlError::NotHttp(_))
        ));
        assert!(matches!(
            parse_replica_url("https://a:443"),
            Err(ReplicaUrlError::NotHttp(_))
        ));
        assert!(matches!(
            parse_replica_url("http://a:8000/v1"),
            Err(ReplicaUrlError::NotBase(_))
        ));
        assert!(matches!(
            parse_replica_url("http://user@a:8000"),
            Err(ReplicaUrlError::NotBase(_))
        ));
        assert!(matches!(
            parse_replica_url("http://a:99999"),
            Err(ReplicaUrlError::BadPort(_))
        ));
        assert!(parse_replica_url("")
            .unwrap_err()
            .to_string()
            .contains("is not a URL"));
    }

    #[test]
    fn dns_targets_need_a_name_and_a_port() {
        assert_eq!(
            parse_dns_target("sluice-replicas.default.svc:8000"),
            Ok(("sluice-replicas.default.svc".to_string(), 8000))
        );
        for bad in ["name", "name:", ":80", "name:http", "name:0", "http://a:80"] {
            assert!(parse_dns_target(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn resolved_addresses_are_ids() {
        let v4: SocketAddr = "10.1.2.3:8000".parse().unwrap();
        let v6: SocketAddr = "[fe80::1]:8000".parse().unwrap();
        assert_eq!(&*replica_id_of(v4).0, "http://10.1.2.3:8000");
        assert_eq!(&*replica_id_of(v6).0, "http://[fe80::1]:8000");
    }
}
