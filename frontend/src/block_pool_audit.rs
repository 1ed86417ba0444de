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
