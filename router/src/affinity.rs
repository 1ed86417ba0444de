//! Stored responses behind the router (`/v1/responses`). Every request the router sends a replica
//! carries that replica's tag (`x-sluice-replica-tag`), which the replica writes into the ids of the
//! responses it stores (`resp_<tag>-...`). A follow-up (`previous_response_id`), or a `GET` or
//! `DELETE` of a stored response (or a `GET` of its `/input_items`), goes to the replica whose tag
//! its id carries: the conversation,
//! and the prefix cache that holds its earlier turns, live there. No state is kept here, so a
//! restarted router routes follow-ups as before.

use crate::policies::ReplicaId;
use crate::replicas::ReplicaSet;
use sluice_common::schema::responses::replica_tag_of;

/// A replica's tag: 12 hex digits of the FNV-1a hash of its URL, the same in every router.
pub fn replica_tag(replica: &ReplicaId) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in replica.0.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{:012x}", hash >> 16)
}

/// Where a request about the stored response `response_id` must go: None when its id carries no
/// tag (it was stored without the router), the replica that stored it, or Err when no replica
/// known now has its tag (the replica is gone, and the conversation with it).
pub fn home_of(replicas: &ReplicaSet, response_id: &str) -> Result<Option<ReplicaId>, String> {
    let Some(tag) = replica_tag_of(response_id) else {
        return Ok(None);
    };
    replicas
        .all()
        .iter()
        .find(|replica| replica_tag(&replica.id) == tag)
        .map(|replica| Some(replica.id.clone()))
        .ok_or_else(|| tag.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(url: &str) -> ReplicaId {
        ReplicaId(url.into())
    }

    #[test]
    fn tags_are_stable_distinct_and_fit_an_id() {
        let a = replica_tag(&id("http://10.0.0.1:8000"));
        assert_eq!(a, replica_tag(&id("http://10.0.0.1:8000")));
        assert_ne!(a, replica_tag(&id("http://10.0.0.2:8000")));
        assert_eq!(a.len(), 12);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        // FNV-1a of the empty string is its offset basis, shifted.
        assert_eq!(
            replica_tag(&id("")),
            format!("{:012x}", 0xcbf2_9ce4_8422_2325u64 >> 16)
        );
    }
}
