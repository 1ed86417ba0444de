//! `GET /sluice/block_pool_audit`: the engine core's audit of its KV block pool, for the
//! disconnect-storm and soak checks (bench/, tests/) that no request leaked a block.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::api_error::ApiError;
use crate::generation::engine_unavailable;
use crate::protocol::{UtilityMethod, UtilityValue};
use crate::server::AppState;

/// The `block_pool_audit` utility result (python/engine/block_pool_audit.py's `to_wire`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockPoolAudit {
    /// True when every block is free or held by a live request and the pool's books agree.
    pub consistent: bool,
    pub num_blocks: u64,
    pub num_free_blocks: u64,
    pub num_held_blocks: u64,
    pub num_cached_blocks: u64,
    pub num_live_requests: u64,
    pub num_holding_requests: u64,
    pub num_problems: u64,
    /// The first problems found, joined with "; " (empty when consistent).
    pub problems: String,
}

pub async fn block_pool_audit(
    State(state): State<Arc<AppState>>,
) -> Result<Json<BlockPoolAudit>, ApiError> {
    match state.engine()?.utility(UtilityMethod::BlockPoolAudit).await {
        Ok(Some(UtilityValue::BlockPoolAudit(audit))) => Ok(Json(audit)),
        Ok(other) => Err(ApiError::Internal(format!(
            "the engine core answered block_pool_audit with {other:?}"
        ))),
        Err(error) => Err(engine_unavailable(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode, encode, Message, UtilityResult};

    #[test]
    fn an_audit_result_decodes_as_an_audit_not_as_another_utility_value() {
        let audit = BlockPoolAudit {
            consistent: false,
            num_blocks: 8,
            num_free_blocks: 6,
            num_held_blocks: 1,
            num_cached_blocks: 2,
            num_live_requests: 0,
            num_holding_requests: 1,
            num_problems: 1,
            problems: "finished request 'a-0' still holds 2 blocks".into(),
        };
        let sent: Message = UtilityResult {
            call_id: 4,
            result: Some(UtilityValue::BlockPoolAudit(audit.clone())),
            error: None,
        }
        .into();
        match decode(&encode(&sent)).unwrap() {
            Message::UtilityResult(UtilityResult {
                result: Some(UtilityValue::BlockPoolAudit(got)),
                ..
            }) => assert_eq!(got, audit),
            other => panic!("decoded as {other:?}"),
        }
    }
}
